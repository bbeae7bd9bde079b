"""Flax linen: FP8 dot_general / einsum modules and a TrainState that keeps FP8 state apart.

Usage:

    dense = nn.Dense(features, dot_general_cls=jax_fp8.flax.Fp8DotGeneral)
    variables = model.init(rng, x)           # {"params": ..., "fp8_meta": ...}
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.adamw(...))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params, fp8):
            logits = state.apply_model(params, fp8, x)
            return xent(logits, y)
        loss, grads = state.value_and_grad(loss_fn)()   # {"params": ..., "fp8_meta": ...}
        return state.apply_gradients(grads=grads), loss

    logits = state.apply_model(state.params, state.fp8, x)      # evaluation

The FP8 state lives in its own variable collection ("fp8_meta"), one ``ScalingState``
per tensor (``input``, ``kernel``, ``grad``) under each FP8 module. The optimizer only
ever sees ``params``; the FP8 collection is replaced, once per step, by the result of one
fused ``update_states`` call (`jax_fp8.new_fp8_state`).

Several uses of one module per step: each call consumes the meta the previous call
returned (written back to the variables when the collection is mutable, else kept for
the rest of the ``apply``), so the amaxes of all calls combine by max (``jax_fp8.meta``).
Under ``nn.scan`` give the collection ``variable_axes={"fp8_meta": 0}`` (a state per
layer, or per iteration of weights tied by ``variable_broadcast="params"``), or
``variable_carry="fp8_meta"`` for one module reused by every iteration (applied with the
collection mutable: Flax carries no read-only collection, and a read-only ``apply``
raises ValueError naming ``mutable=``); a layer that the
collection does not reach (a lifted transform not given it, or ``model.apply`` without it)
raises ValueError naming the line to add. A collection broadcast into a loop body
(``variable_broadcast``) is read there and never written (its threaded meta is kept for
the later calls instead): init and evaluation work, and differentiating it inside a loop
body raises ValueError at trace time (the iterations' amaxes would be summed), naming the
fix. Into an ``nn.vmap`` body (axis None) it is written like any mutable collection, so a
lifted block called twice threads from one call to the next; with the collection
read-only a lifted block (``nn.remat``, ``nn.jit``, ``nn.vmap``) called twice in one
differentiated computation raises ValueError naming the mutable apply.

A loop cannot skip the FP8 update silently: `Fp8TrainState.apply_gradients` refuses
parameter gradients alone while the state holds delayed-scaling states, and
differentiating the layers w.r.t. the parameters but not the FP8 collection raises at
trace time (`jax_fp8._trace_checks.claim`); `jax_fp8.frozen_scales` opts out of both. Under
``optax.MultiSteps`` the amaxes of the microbatches are combined by max and the FP8
state is updated once per optimizer step.

One recipe: the layers create their states from their ``recipe`` (default
``DelayedScaling()``) and `Fp8TrainState` updates them with its own; the two must agree
(``Fp8TrainState.create`` checks every state and names the first that does not).

The layers are here; how they make, read and thread their FP8 variables (and the checks
of lifted transforms) is `jax_fp8.flax._linen_variables`, the train state
`jax_fp8.flax._train_state`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

import jax_fp8.recipes  # noqa: F401  (registers the recipes whose default() is asked below)
from jax_fp8.flax._linen_variables import FP8_COLLECTION, _meta_variables, _read, _write
from jax_fp8.flax._train_state import Fp8TrainState, fp8_value_and_grad, split_fp8
from jax_fp8.gemm.dot_general import fp8_dot_general
from jax_fp8.gemm.einsum import fp8_einsum
from jax_fp8.gemm.ragged_fp8 import fp8_ragged_dot
from jax_fp8.recipe import Recipe, default as default_recipe

__all__ = ["FP8_COLLECTION", "Fp8DotGeneral", "Fp8Einsum", "Fp8TrainState", "fp8_value_and_grad",
           "split_fp8"]


class Fp8DotGeneral(nn.Module):
    """Drop-in ``dot_general_cls`` for ``nn.Dense`` / ``nn.DenseGeneral``: FP8 GEMMs.

    Attributes:
      recipe: DelayedScaling (the default: the states, history length and FP8 format,
        live in ``collection``) or any recipe without state (Float8CurrentScaling,
        Float8BlockScaling, MXFP8BlockScaling).
      collection: the variable collection holding the FP8 state.
      min_fp8_flops: GEMMs with fewer FLOPs (2 * batch * M * N * K) run in the operands'
        dtype, not FP8 (`jax_fp8.fp8_dot_general`); 0 (the default): every GEMM is FP8.

    Example:

        dg = functools.partial(Fp8DotGeneral, recipe=jax_fp8.Float8BlockScaling())
        nn.Dense(1024, dot_general_cls=dg)
    """

    recipe: Recipe = default_recipe()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float | str = 0

    @nn.compact
    def __call__(self, lhs: jax.Array | None = None, rhs: Any = None,
                 dimension_numbers: Any = None, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        del kwargs  # e.g. out_sharding
        if lhs is None:  # nn.Dense calls dot_general_cls() to make the dot_general
            raise TypeError(
                "Fp8DotGeneral was given as an instance where a class is taken: use "
                "nn.Dense(..., dot_general_cls=Fp8DotGeneral) or dot_general_cls="
                "functools.partial(Fp8DotGeneral, recipe=...); an instance goes in "
                "nn.Dense(..., dot_general=Fp8DotGeneral(...))")
        vs = _meta_variables(self, self.recipe, self.collection)
        used = _read(self, vs, self.recipe, self.collection, "Fp8DotGeneral")
        out, meta = fp8_dot_general(lhs, rhs, dimension_numbers, used, precision,
                                    preferred_element_type, min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, meta, self.collection)
        return out


class Fp8Einsum(nn.Module):
    """Two-operand FP8 einsum: ``Fp8Einsum()("bsd,dh->bsh", x, kernel)``; rhs is the kernel.
    Attributes as `Fp8DotGeneral`'s."""

    recipe: Recipe = default_recipe()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float | str = 0

    @nn.compact
    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
                 preferred_element_type: Any = None) -> jax.Array:
        del precision
        vs = _meta_variables(self, self.recipe, self.collection)
        used = _read(self, vs, self.recipe, self.collection, "Fp8Einsum")
        out, meta = fp8_einsum(eqn, lhs, rhs, used,
                               preferred_element_type=preferred_element_type,
                               min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, meta, self.collection)
        return out


class _WeightFp8(nn.Module):
    """The FP8 state of one weight of a module, for every GEMM that multiplies it.

    What `jax_fp8.flax.fp8_model` creates, named ``<weight>_fp8``, for a converted
    module's own ``dot_general`` / ``einsum`` calls with a parameter ``<weight>`` as an
    operand: its variables are those of an `Fp8DotGeneral` / `Fp8Einsum` of that name
    (``input``, ``kernel``, ``grad``), whichever of the two GEMMs a call is; the weight is
    the rhs (the kernel). Calls: ``("dot_general", (lhs, rhs, dimension_numbers),
    precision, preferred_element_type)``, ``("einsum", (eqn, lhs, rhs), ...)`` or
    ``("ragged_dot", (lhs, rhs, group_sizes), ...)``: a mixture-of-experts layer's grouped
    GEMM (`jax_fp8.fp8_ragged_dot`) of an expert weight rhs [G, K, N], whose states are one
    per expert (leading axis G). Attributes as `Fp8DotGeneral`'s.
    """

    recipe: Recipe = default_recipe()
    collection: str = FP8_COLLECTION
    min_fp8_flops: float | str = 0

    @nn.compact
    def __call__(self, kind: str, args: tuple[Any, Any, Any], precision: Any = None,
                 preferred_element_type: Any = None) -> jax.Array:
        op = {"dot_general": "Fp8DotGeneral", "einsum": "Fp8Einsum"}.get(kind, "fp8_ragged_dot")
        shape = (args[1].shape[0],) if kind == "ragged_dot" else ()
        vs = _meta_variables(self, self.recipe, self.collection, op, shape)
        used = _read(self, vs, self.recipe, self.collection, op)
        if kind == "ragged_dot":
            out, meta = fp8_ragged_dot(*args, used, precision=precision,
                                       preferred_element_type=preferred_element_type,
                                       min_fp8_flops=self.min_fp8_flops)
        elif kind == "dot_general":
            out, meta = fp8_dot_general(*args, used, precision, preferred_element_type,
                                        min_fp8_flops=self.min_fp8_flops)
        else:
            out, meta = fp8_einsum(*args, used, preferred_element_type=preferred_element_type,
                                   min_fp8_flops=self.min_fp8_flops)
        _write(self, vs, meta, self.collection)
        return out
