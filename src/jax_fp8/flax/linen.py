"""Flax linen: FP8 dot_general / einsum modules and a TrainState that keeps FP8 state apart.

Usage::

    dense = nn.Dense(features, dot_general_cls=jax_fp8.flax.Fp8DotGeneral)
    variables = model.init(rng, x)           # {"params": ..., "fp8_meta": ...}
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.adamw(...))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params, fp8):
            logits = state.apply_model(params, fp8, x)
            return xent(logits, y)
        loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.fp8)
        return state.apply_gradients(grads=grads, fp8_grads=fp8_grads), loss

The FP8 state lives in its own variable collection ("fp8_meta"), one ``ScalingState``
per tensor (``input``, ``kernel``, ``grad``) under each FP8 module. The optimizer only
ever sees ``params``; the FP8 collection is replaced, once per step, by the result of one
fused ``update_states`` call (`jax_fp8.new_fp8_state`).

Several uses of one module per step: each call consumes the meta the previous call
returned (written back to the variables when the collection is mutable, else kept for
the rest of the ``apply``), so the amaxes of all calls combine by max (``jax_fp8.meta``).
Under ``nn.scan`` give the collection ``variable_axes={"fp8_meta": 0}`` (a state per
layer), or ``variable_carry="fp8_meta"`` for one module reused by every iteration.

One recipe: the layers create their states from their ``recipe`` (default
``DelayedScaling()``) and `Fp8TrainState` updates them with its own; the two must agree
(``Fp8TrainState.create`` checks every state and names the first that does not).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

from jax_fp8 import recipe as recipe_lib
from jax_fp8 import state as state_lib
from jax_fp8.dot_general import fp8_dot_general
from jax_fp8.einsum import fp8_einsum
from jax_fp8.meta import Fp8Meta, new_fp8_state
from jax_fp8.packing import PackedStates, pack_states, unpack_states
from jax_fp8.state import ScalingState

FP8_COLLECTION = "fp8_meta"
_NAMES = ("input", "kernel", "grad")


def _meta_variables(module: nn.Module, recipe, collection):
    recipe_lib.check_recipe(recipe, "recipe")
    if not isinstance(recipe, recipe_lib.DelayedScaling):
        return None  # current / blockwise scaling: no state
    fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    dtypes = {"input": fwd, "kernel": fwd, "grad": bwd}
    return [module.variable(collection, name, ScalingState.create, (), recipe.history_len,
                            dtypes[name]) for name in _NAMES]


# A module applied with its FP8 collection immutable cannot write the threaded meta back;
# the meta its call returned is kept here, keyed by the variable value it replaces, for
# the next call in the same apply (values are identical: only the dataflow changes).
_successor: dict = {}


def _read(vs, recipe) -> Fp8Meta:
    if vs is None:
        return Fp8Meta(recipe=recipe)
    meta = Fp8Meta(*(v.value for v in vs))
    while True:
        entry = _successor.get(id(meta.input.amax_history))
        if entry is None or entry[0]() is not meta.input.amax_history:
            return meta
        meta = entry[1]


def _write(module: nn.Module, vs, used: Fp8Meta, meta: Fp8Meta, collection):
    # Thread the meta: the next call of this module consumes what this one returned, so
    # the amaxes of all calls combine by max.
    if vs is None:
        return
    if module.is_mutable_collection(collection):
        for v, name in zip(vs, _NAMES):
            v.value = getattr(meta, name)
        return
    leaf = used.input.amax_history
    try:
        ref = weakref.ref(leaf, lambda _, k=id(leaf), d=_successor: d.pop(k, None))
    except TypeError:  # not weak-referenceable (e.g. a NumPy array): nothing to thread
        return
    _successor[id(leaf)] = (ref, meta)


class Fp8DotGeneral(nn.Module):
    """Drop-in ``dot_general_cls`` for ``nn.Dense`` / ``nn.DenseGeneral``: FP8 GEMMs.

    Attributes:
      recipe: DelayedScaling (the default: the states, history length and FP8 format,
        live in ``collection``), Float8CurrentScaling or Float8BlockScaling (no state).
      collection: the variable collection holding the FP8 state.
      min_fp8_flops: GEMMs with fewer FLOPs (2 * batch * M * N * K) run in the operands'
        dtype, not FP8 (`jax_fp8.fp8_dot_general`); 0 (the default): every GEMM is FP8.

    Example::

        dg = functools.partial(Fp8DotGeneral, recipe=jax_fp8.Float8BlockScaling())
        nn.Dense(1024, dot_general_cls=dg)
    """

    recipe: recipe_lib.DelayedScaling | recipe_lib.Float8CurrentScaling | \
        recipe_lib.Float8BlockScaling = recipe_lib.DelayedScaling()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float = 0

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        del kwargs  # e.g. out_sharding
        vs = _meta_variables(self, self.recipe, self.collection)
        used = _read(vs, self.recipe)
        out, meta = fp8_dot_general(lhs, rhs, dimension_numbers, used, precision,
                                    preferred_element_type, min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, used, meta, self.collection)
        return out


class Fp8Einsum(nn.Module):
    """Two-operand FP8 einsum: ``Fp8Einsum()("bsd,dh->bsh", x, kernel)``; rhs is the kernel.
    Attributes as `Fp8DotGeneral`'s."""

    recipe: recipe_lib.DelayedScaling | recipe_lib.Float8CurrentScaling | \
        recipe_lib.Float8BlockScaling = recipe_lib.DelayedScaling()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float = 0

    @nn.compact
    def __call__(self, eqn, lhs, rhs, precision=None, preferred_element_type=None):
        del precision
        vs = _meta_variables(self, self.recipe, self.collection)
        used = _read(vs, self.recipe)
        out, meta = fp8_einsum(eqn, lhs, rhs, used,
                               preferred_element_type=preferred_element_type,
                               min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, used, meta, self.collection)
        return out


def split_fp8(variables, collection: str = FP8_COLLECTION):
    """``{"params": p, "fp8_meta": f, ...}`` -> (everything but the FP8 collection, f)."""
    variables = dict(variables)
    fp8 = variables.pop(collection, {})
    return variables, fp8


class Fp8TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` plus the FP8 state, outside the optimizer.

    ``params`` and ``opt_state`` are exactly those of a plain TrainState (the FP8
    collection never reaches optax: no Adam moments, clipping or weight decay for it).
    ``fp8`` holds the FP8 collection; `apply_gradients` replaces it with one fused
    ``update_states`` call driven by ``fp8_grads``.
    """

    fp8: Any = None
    # {FP8 dtype name: number of states}: in the tree (and so in every checkpoint), so a
    # restore into a state of another FP8 format fails on the keys instead of relabelling.
    fp8_formats: Any = None
    recipe: recipe_lib.DelayedScaling = struct.field(pytree_node=False,
                                                     default=recipe_lib.DelayedScaling())
    fp8_collection: str = struct.field(pytree_node=False, default=FP8_COLLECTION)

    @classmethod
    def create(cls, *, apply_fn, tx, variables=None, params=None, fp8=None,
               recipe: recipe_lib.DelayedScaling | None = None,
               fp8_collection: str = FP8_COLLECTION, pack_fp8: bool = True, **kwargs):
        """From ``variables`` (as returned by ``model.init``), or ``params`` and ``fp8``.

        recipe: the DelayedScaling recipe of the update (default ``DelayedScaling()``).
          Every FP8 state must have been created by the same recipe (history length and
          FP8 dtypes; the layers' ``recipe`` attribute): a mismatch raises ValueError.
        pack_fp8: keep the FP8 collection packed into one stacked state per (FP8 dtype,
          history length) (`jax_fp8.pack_states`, the default): the step then takes 3
          arrays per group instead of 3 per FP8 tensor, which cuts JAX's per-argument
          host cost, the fused update runs on stacked states, and a checkpoint records
          each group's FP8 dtype. The layers still see their own states. False keeps the
          collection as the model made it.
        """
        if variables is not None:
            if params is not None or fp8 is not None:
                raise ValueError("pass either variables, or params (and fp8), not both")
            rest, fp8 = split_fp8(variables, fp8_collection)
            if set(rest) != {"params"}:
                raise ValueError(f"variables has collections {sorted(rest)}; expected only "
                                 f"'params' and {fp8_collection!r}. Pass params= and fp8= "
                                 "and keep the other collections yourself")
            params = rest["params"]
        recipe = recipe_lib.DelayedScaling() if recipe is None else recipe
        recipe_lib.check_recipe(recipe, "recipe")
        fp8 = {} if fp8 is None else fp8
        state_lib.check_states_follow(recipe, fp8, "fp8")
        counts: dict = {}
        for _, dtype, _ in state_lib.states_info(fp8):
            counts[dtype.name] = counts.get(dtype.name, 0) + 1
        formats = {name: jnp.int32(n) for name, n in sorted(counts.items())}
        if pack_fp8 and not isinstance(fp8, PackedStates):
            fp8 = pack_states(fp8)
        return super().create(apply_fn=apply_fn, params=params, tx=tx, fp8=fp8,
                              fp8_formats=formats, recipe=recipe,
                              fp8_collection=fp8_collection, **kwargs)

    def variables(self, params=None, fp8=None) -> dict:
        """The model's variables; a packed FP8 state is handed to the layers unpacked."""
        fp8 = self.fp8 if fp8 is None else fp8
        return {"params": self.params if params is None else params,
                self.fp8_collection: unpack_states(fp8)}

    def apply_model(self, params, fp8, *args, mutable=(), **kwargs):
        """``apply_fn`` with the FP8 collection mutable (so reused modules thread their state).

        Returns the output; with extra ``mutable`` collections, (output, their updates).
        """
        extra = [mutable] if isinstance(mutable, str) else list(mutable)
        out, updates = self.apply_fn(self.variables(params, fp8), *args,
                                     mutable=[self.fp8_collection, *extra], **kwargs)
        if extra:
            updates = dict(updates)
            updates.pop(self.fp8_collection, None)
            return out, updates
        return out

    def apply_gradients(self, *, grads, fp8_grads=None, **kwargs):
        """The optimizer step on ``params``, and the FP8 state from ONE ``update_states``."""
        new = super().apply_gradients(grads=grads, **kwargs)
        if fp8_grads is None or not isinstance(self.recipe, recipe_lib.DelayedScaling):
            return new
        return new.replace(fp8=new_fp8_state(self.fp8, fp8_grads, self.recipe))


def fp8_value_and_grad(loss_fn: Callable, has_aux: bool = False):
    """``loss_fn(params, fp8, *args)`` -> f returning ``(loss[, aux]), (grads, fp8_grads)``."""
    return jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=has_aux)
