"""Fp8Meta (the FP8 state of one GEMM) and how observed amaxes leave a train step.

`fp8_dot_general` never updates state. It quantizes with the *current* scales (delayed
scaling) and reports what it observed -- the amax of its input, of its kernel and, in the
backward pass, of the incoming gradient -- as the **cotangent of its `Fp8Meta` argument**:
the "gradient" w.r.t. each state's ``amax_history`` is zero except in the staging slot
``[..., 0]``, which holds the observed amax. `new_fp8_state(meta, meta_grads, recipe)` then
reads those slots and updates the whole model's FP8 state with ONE `update_states` call.

Amaxes combine by max, never by sum (``docs/semantics.md``, "Several uses of one state"):

* the op is *threaded*: ``out, meta = fp8_dot_general(x, w, dn, meta)``; the backward of
  each use emits ``fmax(cotangent of the meta it returned, its own amax)``, so a chain
  ``meta0 -> use 1 -> meta1 -> use 2`` reports ``max(amax_1, amax_2)``. The Flax layers
  thread for you. Passing one meta value to two uses is an error at trace time;
* under ``jax.vmap`` with one shared (unbatched) meta, the amax is the max over the batch;
* microbatches: combine their FP8 gradients with `combine_fp8_grads` (max), not ``+``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import weakref

import jax
import jax.export  # noqa: F401  (register_pytree_node_serialization)
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_fp8 import recipe as recipe_lib
from jax_fp8 import state as state_lib
from jax_fp8._primitives import amax as amax_lib
from jax_fp8.state import ScalingState, is_state
from jax_fp8.update import update_states

__all__ = ["Fp8Meta", "amax_cotangents", "combine_fp8_grads", "new_fp8_state"]

try:  # the trace a value belongs to (jax >= 0.4.36 stackless tracing); no public API
    from jax._src import core as _jax_core
    _current_trace = lambda: _jax_core.trace_ctx.trace  # noqa: E731
except (ImportError, AttributeError):  # pragma: no cover
    _current_trace = lambda: None  # noqa: E731

_LOOPS = ("scan", "fori_loop", "while_body", "while_cond", "while_loop")
_BRANCHES = ("cond", "switch")
_AD_TRACES = ("JVPTrace", "LinearizeTrace")
# Tracers already handed to an FP8 op as (part of) a meta: id -> (tracer, trace under it).
_consumed: dict = {}


@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """What one GEMM needs to run in FP8: its recipe, and for delayed scaling its states.

    Delayed scaling (``recipe=None``): a registered pytree of three `ScalingState`s, for
    its input (lhs), its kernel (rhs) and its output gradient; the input and kernel use
    ``fp8_format.fwd_dtype`` and the gradient ``fp8_format.bwd_dtype`` (E5M2 under
    HYBRID). Current and blockwise scaling keep no state: ``input``, ``kernel`` and
    ``grad`` are None and the (static) ``recipe`` says how to scale. The functional call
    is the same for all three recipes.

    Example::

        meta = Fp8Meta.create(DelayedScaling(history_len=16))     # or Float8BlockScaling()
        out, meta = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta)
    """

    input: ScalingState | None = None
    kernel: ScalingState | None = None
    grad: ScalingState | None = None
    recipe: recipe_lib.Float8CurrentScaling | recipe_lib.Float8BlockScaling | None = None

    @classmethod
    def create(cls, recipe=None, shape=(), history_len: int | None = None) -> "Fp8Meta":
        """Fresh states for one GEMM (``shape``: leading axes, e.g. stacked layers), or the
        stateless meta of a current/blockwise recipe."""
        recipe = recipe_lib.DelayedScaling() if recipe is None else recipe
        recipe_lib.check_recipe(recipe, "recipe")
        if not isinstance(recipe, recipe_lib.DelayedScaling):
            return cls(recipe=recipe)
        n = recipe.history_len if history_len is None else history_len
        fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
        return cls(input=ScalingState.create(shape, n, fwd),
                   kernel=ScalingState.create(shape, n, fwd),
                   grad=ScalingState.create(shape, n, bwd))

    @property
    def stateless(self) -> bool:
        """True for the current and blockwise recipes (no state to update)."""
        return self.recipe is not None

    def replace(self, **changes) -> "Fp8Meta":
        """A copy with the given fields replaced (as ``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(Fp8Meta, data_fields=["input", "kernel", "grad"],
                                 meta_fields=["recipe"])


def _serialize_aux(aux) -> bytes:
    (recipe,) = aux
    if recipe is None:
        return b"null"
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    fields["fp8_format"] = fields["fp8_format"].value
    return json.dumps({"recipe": type(recipe).__name__, **fields}).encode()


def _deserialize_aux(data: bytes):
    fields = json.loads(data.decode())
    if fields is None:
        return (None,)
    cls = {c.__name__: c for c in recipe_lib.RECIPES}[fields.pop("recipe")]
    fields["fp8_format"] = recipe_lib.Format(fields["fp8_format"])
    return (cls(**fields),)


jax.export.register_pytree_node_serialization(
    Fp8Meta, serialized_name="jax_fp8.Fp8Meta", serialize_auxdata=_serialize_aux,
    deserialize_auxdata=_deserialize_aux)


def amax_cotangent(ct: ScalingState, amax, primal: ScalingState) -> ScalingState:
    """The cotangent one use hands back: fmax(downstream uses' amax, this use's amax).

    Where nothing downstream used the threaded meta (a symbolic zero cotangent), the
    staging slot is this use's amax itself: fmax(0, amax) would change nothing that the
    update's own fmaxf(h[0], amax) does not already do, and skipping it spares the step
    one scalar kernel per state. The result is then given the batching of ``primal``
    (`amax_lib.amax_for_state`): under ``vmap`` with one shared state the batch's amaxes
    are reduced by max here, before JAX would sum them.
    """
    h = ct.amax_history
    amax = jnp.asarray(amax, jnp.float32)
    if isinstance(h, SymbolicZero):
        staged = amax
    else:
        staged = jnp.fmax(h[..., 0], amax)
    staged = amax_lib.amax_for_state(staged, primal.scale)
    zeros = jnp.zeros_like(primal.amax_history)
    scale_zeros = jnp.zeros_like(primal.scale)
    return ScalingState(zeros.at[..., 0].set(staged), scale_zeros, scale_zeros,
                        fp8_dtype=primal.fp8_dtype)


def _traced_for(trace):
    return getattr(getattr(getattr(trace, "frame", None), "debug_info", None), "traced_for",
                   None)


def _chain(leaf):
    """The traces between the current one and `leaf`'s own, innermost first (None when
    `leaf`'s trace is not an ancestor of the current one)."""
    t, chain, own = _current_trace(), [], getattr(leaf, "_trace", None)
    while t is not None and t is not own:
        chain.append(t)
        t = getattr(t, "parent_trace", None)
    return chain if t is not None else None


_REUSE = ("{op}: this Fp8Meta was already given to another FP8 op in the same "
          "computation, so their amaxes would be summed instead of maxed. Thread it: "
          "`out, meta = {op}(..., meta)` and pass the returned meta to the next use (the "
          "Flax layers do this). For several microbatches use combine_fp8_grads.")
_LOOP = ("{op}: this Fp8Meta is differentiated but closed over by a `{loop}` body, so "
         "JAX would sum its amaxes over the iterations instead of taking their max. Pass "
         "it through the loop instead: in the carry (and return the threaded meta from "
         "the body), or one meta per iteration as `xs` (nn.scan: variable_axes="
         "{{'fp8_meta': 0}}, or variable_carry='fp8_meta').")


def claim(meta, op: str) -> None:
    """Trace-time check that a differentiated `meta` is used once.

    A second use of the same meta value, or a meta closed over by a loop body, would make
    JAX sum the amax cotangents; both raise ValueError when the meta is being
    differentiated (its leaves are tracers of ``grad``/``vjp``/``jvp``). Metas that are not
    differentiated (inference) may be reused freely: their cotangents are never formed.
    (Inside a function that is jitted and only then differentiated, as
    ``jax.grad(jax.jit(f))``, the check cannot see the differentiation.)
    """
    for leaf in jax.tree.leaves(meta):
        if not isinstance(leaf, jax.core.Tracer) or \
                type(getattr(leaf, "_trace", None)).__name__ not in _AD_TRACES:
            continue
        chain = _chain(leaf) or []
        loop = next((_traced_for(t) for t in chain if _traced_for(t) in _LOOPS), None)
        if loop is not None:
            raise ValueError(_LOOP.format(op=op, loop=loop))
        top = chain[-1] if chain else None
        seen = _consumed.get(id(leaf))
        if seen is not None and seen[0]() is leaf:
            prev_top = seen[1]() if seen[1] is not None else None
            both_branches = (_traced_for(top) in _BRANCHES and
                             _traced_for(prev_top) in _BRANCHES)
            if not both_branches:  # the two branches of a cond never both run
                raise ValueError(_REUSE.format(op=op))
        key = id(leaf)
        _consumed[key] = (weakref.ref(leaf, lambda _, k=key, d=_consumed: d.pop(k, None)),
                          None if top is None else weakref.ref(top))


def amax_cotangents(fp8_grads):
    """The observed amaxes carried by FP8 gradients: each ScalingState -> its staging slot."""
    return jax.tree.map(lambda g: g.amax_history[..., 0], fp8_grads, is_leaf=is_state)


def new_fp8_state(fp8_states, fp8_grads, recipe: recipe_lib.DelayedScaling | None = None,
                  *, axis_name=None, implementation: str = "auto"):
    """The step's new FP8 state: ONE `update_states` call for every state of the model.

    Args:
      fp8_states: any pytree of ScalingStates (e.g. Fp8Metas, a Flax collection, a
        `PackedStates`).
      fp8_grads: the gradient of the loss w.r.t. ``fp8_states`` (same structure); the
        staging slot ``amax_history[..., 0]`` of each holds the amax observed this step.
      recipe: the DelayedScaling recipe (margin, algorithm, ...). When given, every
        state's FP8 dtype must be the one the recipe gives it (checked at trace time).
      axis_name: inside ``shard_map`` / ``pmap``, the axis (or axes) whose devices'
        amaxes are combined, with one ``pmax`` for all of them (see ``update_states``).

    Returns:
      ``fp8_states`` updated (same structure).
    """
    if recipe is None:
        recipe = recipe_lib.DelayedScaling()
    else:
        state_lib.check_states_follow(recipe, fp8_states, "fp8_states")
    return update_states(fp8_states, amax_cotangents(fp8_grads), recipe=recipe,
                         axis_name=axis_name, implementation=implementation)


def combine_fp8_grads(*fp8_grads):
    """Combines the FP8 gradients of several microbatches (or steps) by max, never sum."""
    if not fp8_grads:
        raise ValueError("combine_fp8_grads needs at least one gradient tree")

    def combine(*gs):
        first = gs[0]
        if not is_state(first):
            return first
        staged = functools.reduce(jnp.fmax, [g.amax_history[..., 0] for g in gs])
        return ScalingState(jnp.zeros_like(first.amax_history).at[..., 0].set(staged),
                            jnp.zeros_like(first.scale), jnp.zeros_like(first.scale_inv),
                            fp8_dtype=first.fp8_dtype)

    return jax.tree.map(combine, *fp8_grads, is_leaf=is_state)
