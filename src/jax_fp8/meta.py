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

A delayed-scaling GEMM differentiated w.r.t. its operands but not its meta would drop the
amaxes, and its scales would never change: that is an error at trace time (`claim`),
unless the scales are frozen on purpose (`frozen_scales`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import jax
import jax.export  # noqa: F401  (register_pytree_node_serialization)
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_fp8 import _compat, recipe as recipe_lib, state as state_lib
from jax_fp8._primitives import amax as amax_lib
from jax_fp8.state import HoldsStates, ScalingState, is_state
from jax_fp8.update import update_states

__all__ = ["AmaxGrad", "Fp8Meta", "amax_cotangents", "check_fp8_updated", "combine_fp8_grads",
           "fp8_grads_from_cotangents", "frozen_scales", "new_fp8_state", "scales_frozen"]

# What a staging trace of a loop body traces for (`_compat.traced_for`).
LOOPS = ("scan", "fori_loop", "while_body", "while_cond", "while_loop")
BRANCHES = ("cond", "switch")
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

    Example:

        meta = Fp8Meta.create(DelayedScaling(history_len=16))     # or Float8BlockScaling()
        out, meta = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta)
    """

    input: ScalingState | None = None
    kernel: ScalingState | None = None
    grad: ScalingState | None = None

    # The names of its three states (the FP8 layers' variables are named so).
    STATES = ("input", "kernel", "grad")
    recipe: recipe_lib.Recipe | None = None

    @classmethod
    def create(cls, recipe: recipe_lib.Recipe | None = None, shape: Sequence[int] = (),
               history_len: int | None = None) -> Fp8Meta:
        """Fresh states for one GEMM (``shape``: leading axes, e.g. stacked layers), or the
        stateless meta of a current/blockwise recipe."""
        recipe = recipe_lib.default() if recipe is None else recipe
        return recipe_lib.check_recipe(recipe, "recipe").create_meta(shape, history_len)

    @property
    def stateless(self) -> bool:
        """True for a recipe that keeps no state (current, blockwise, MXFP8)."""
        return self.recipe is not None

    def replace(self, **changes: Any) -> Fp8Meta:
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
    cls = recipe_lib.by_name(fields.pop("recipe"))
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


# ------------------------------------------------------------------ FP8 gradients

def _not_a_key(*_: Any, **__: Any) -> Any:
    raise TypeError("a jax_fp8 FP8 gradient (AmaxGrad) holds observed amaxes, not a random key")


# The dtype of an FP8 gradient's array: JAX's extended (key) dtypes accept no arithmetic,
# no conversion to a number and no reduction, so generic gradient code (a scaling, a
# clip, a sum, a norm, a pmean) given one raises at trace time, its message naming
# this dtype, instead of changing what the update reads. Its data is the amax's float32
# bit pattern (uint32 [..., 1]).
AMAX_DTYPE_TAG = ("jax_fp8 FP8 gradient: observed amaxes, no arithmetic; "
                  "see docs/semantics.md#fp8-gradients")
_AMAX_IMPL = jax.extend.random.define_prng_impl(
    key_shape=(1,), seed=_not_a_key, split=_not_a_key, random_bits=_not_a_key,
    fold_in=_not_a_key, name="jax_fp8.AmaxGrad", tag=AMAX_DTYPE_TAG)


def _encode_amax(amax) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.uint32)
    return jax.random.wrap_key_data(bits[..., None], impl=_AMAX_IMPL)


def _is_amax_array(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
            and jax.random.key_impl(x) == _AMAX_IMPL)


_NOT_AN_AMAX = ("{where}: an FP8 gradient (AmaxGrad) holds {what} where the update reads the "
                "observed amaxes; something other than jax_fp8 rebuilt it (e.g. "
                "`jax.tree.map(f, grads)` over the whole gradient). Apply gradient transforms "
                "to the parameter gradients only (grads['params'], or the nnx.Param part), "
                "combine FP8 gradients with jax_fp8.combine_fp8_grads, and pass them to the "
                "update as the value_and_grad of jax_fp8 returned them.")


@dataclasses.dataclass(frozen=True)
class AmaxGrad:
    """The FP8 gradient of one `ScalingState` (or a stack of them): the amaxes its tensor
    had in a step, in a leaf that refuses arithmetic.

    What `jax_fp8.flax.fp8_value_and_grad`, `Fp8TrainState.value_and_grad` and NNX's
    `fp8_value_and_grad` return for each state (`fp8_grads_from_cotangents` makes them
    from JAX's raw cotangents). Its one leaf ``amax`` is an array of the state's lead shape
    whose dtype is an extended JAX dtype (``key<jax_fp8 FP8 gradient ...>``), holding the
    amax's float32 bits: it passes through ``jit``, ``lax.scan`` / ``cond`` carries,
    ``pmap``, ``device_put``, ``jnp.zeros_like`` (a zero amax) and pytree round trips,
    and every arithmetic operation, conversion to a number, reduction or collective on it
    raises ``TypeError`` at trace time. Combine several with `combine_fp8_grads` (max).

    Attributes:
      amax: the amaxes, an array of the extended dtype, shape = the state's scale shape.
    """

    amax: Any

    def value(self, where: str = "fp8_grads") -> jax.Array:
        """The amaxes as float32 (the state's scale shape)."""
        if not _is_amax_array(self.amax):
            what = (f"a {getattr(self.amax, 'dtype', type(self.amax).__name__)} array"
                    if hasattr(self.amax, "dtype") else type(self.amax).__name__)
            raise TypeError(_NOT_AN_AMAX.format(where=where, what=what))
        bits = jax.random.key_data(self.amax)[..., 0]
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    @classmethod
    def of(cls, amax) -> AmaxGrad:
        """The FP8 gradient of observed amaxes ``amax`` (float32, the state's scale shape)."""
        return cls(_encode_amax(amax))


def _amax_grad_flatten(g: AmaxGrad):
    state_lib.check_not_optax()
    return (g.amax,), None


def _amax_grad_flatten_with_keys(g: AmaxGrad):
    state_lib.check_not_optax()
    return ((jax.tree_util.GetAttrKey("amax"), g.amax),), None


jax.tree_util.register_pytree_with_keys(
    AmaxGrad, _amax_grad_flatten_with_keys, lambda _, children: AmaxGrad(*children),
    flatten_func=_amax_grad_flatten)


_NOT_EXPORTABLE = (
    "jax.export cannot serialize a function taking or returning FP8 gradients (AmaxGrad): "
    "their arrays are of an extended dtype that jax.export does not serialize. Export "
    "the step with the FP8 update inside it, taking and returning FP8 states "
    "(Fp8TrainState.apply_gradients, jax_fp8.new_fp8_state, NNX's update_fp8), or "
    "return the amaxes as float32 (AmaxGrad.value()).")


def _refuse_export(_: Any) -> Any:
    raise ValueError(_NOT_EXPORTABLE)


# Registered so that serializing names the fix instead of JAX's "unregistered type".
jax.export.register_pytree_node_serialization(
    AmaxGrad, serialized_name="jax_fp8.AmaxGrad", serialize_auxdata=_refuse_export,
    deserialize_auxdata=_refuse_export)


def _is_grad_leaf(x) -> bool:
    return is_state(x) or isinstance(x, AmaxGrad)


def fp8_grads_from_cotangents(cotangents: Any) -> Any:
    """JAX's raw cotangent of FP8 states -> FP8 gradients that refuse arithmetic.

    ``jax.grad`` with respect to FP8 states returns, for each `ScalingState`, a
    ScalingState-shaped float cotangent whose staging slot holds the observed amax: plain
    floats, which a gradient transform (a loss scale, a clip, a sum) would change
    without notice. This replaces each by its `AmaxGrad`; call it where ``jax.grad``
    returns, before anything else touches the gradient. `AmaxGrad`s and other leaves are
    kept as they are.
    """
    return jax.tree.map(lambda x: AmaxGrad.of(x.amax_history[..., 0]) if is_state(x) else x,
                        cotangents, is_leaf=_is_grad_leaf)


def holds_fp8_grads(tree: Any) -> bool:
    """Whether ``tree`` holds an FP8 gradient (an `AmaxGrad`, a raw ScalingState
    cotangent, or a packed group of either)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: _is_grad_leaf(x) or
                             isinstance(x, HoldsStates))
    return any(_is_grad_leaf(x) or (isinstance(x, HoldsStates) and bool(x.slot_info()))
               for x in leaves)


def _chain(leaf):
    """The traces between the current one and `leaf`'s own, innermost first (None when
    `leaf`'s trace is not an ancestor of the current one)."""
    t, chain, own = _compat.current_trace(), [], _compat.trace_of(leaf)
    while t is not None and t is not own:
        chain.append(t)
        t = _compat.parent_trace(t)
    return chain if t is not None else None


_REUSE = ("{op}: this Fp8Meta was already given to another FP8 op in the same "
          "computation, so their amaxes would be summed instead of maxed. Thread it: "
          "`out, meta = {op}(..., meta)` and pass the returned meta to the next use (the "
          "Flax layers do this). Two applications of one model on the same FP8 state in "
          "one differentiated function (`state.apply_model` or `model.apply` twice) are "
          "such a second use: apply it once (e.g. on the inputs concatenated), or call its "
          "layers twice inside one apply, where they thread. For several microbatches "
          "differentiate each and use combine_fp8_grads.")
_LOOP = ("{op}: this Fp8Meta is differentiated but closed over by a `{loop}` body, so "
         "JAX would sum its amaxes over the iterations instead of taking their max. Pass "
         "it through the loop instead: in the carry (and return the threaded meta from "
         "the body), or one meta per iteration as `xs` (nn.scan: variable_axes="
         "{{'fp8_meta': 0}}, or variable_carry='fp8_meta').")


_DROPPED = ("{op}: its operands are being differentiated but its delayed-scaling Fp8Meta "
            "is not, so the amaxes it observes would be dropped and its scales would never "
            "change. Differentiate the FP8 state too: jax.value_and_grad(loss_fn, "
            "argnums=(0, 1))(params, fp8) and jax_fp8.new_fp8_state(fp8, fp8_grads, recipe); "
            "with Flax, state.value_and_grad(loss_fn)(...) (linen Fp8TrainState) or "
            "jax_fp8.flax.nnx.fp8_value_and_grad(loss_fn)(model, ...) (NNX). To keep the "
            "scales frozen on purpose (e.g. gradients w.r.t. the inputs only), trace under "
            "`with jax_fp8.frozen_scales():`.")

# Part of jit's cache key: a function traced outside `frozen_scales` is traced anew
# inside it, and the other way round.
_FROZEN = _compat.jit_key_flag(
    "jax_fp8_frozen_scales", "Set by jax_fp8.frozen_scales(): FP8 scales are not updated.")


@contextlib.contextmanager
def frozen_scales() -> Iterator[None]:
    """Context in which no delayed-scaling state changes: the scales are frozen.

    Everything traced inside it keeps the FP8 state as it is, whatever the loop:

    * differentiating a delayed-scaling `fp8_dot_general` / `fp8_einsum` w.r.t. its
      operands alone is allowed (outside the context it raises ValueError at trace time,
      the amaxes would be dropped); the GEMM uses its current scales;
    * `new_fp8_state` returns the states unchanged, so `Fp8TrainState.apply_gradients`,
      NNX `apply_gradients` / `update_fp8` / `Fp8Optimizer.update` step the optimizer on
      the parameters and leave the FP8 state (and, under ``optax.MultiSteps``, its
      pending amaxes) as it is, with or without FP8 gradients: the one-call path
      (``state.value_and_grad`` then ``apply_gradients(grads=grads)``) is frozen too.

    `update_states`, the bare fused update of a pytree of states, is not affected. The
    context acts on tracing and is part of ``jit``'s cache key (as a JAX configuration
    option), so a jitted function means the same whether it was first traced inside the
    context or outside it: called inside, it is frozen; called outside, it is not.

    Example (a saliency map of a trained model):

        with jax_fp8.frozen_scales():
            dx = jax.grad(lambda x: jnp.sum(model.apply(variables, x)))(x)
    """
    with _FROZEN(True):
        yield


def scales_frozen() -> bool:
    """True inside `frozen_scales` (in this thread)."""
    return bool(_FROZEN.value)


def _ad_trace(x):
    """The differentiation (JVP / linearize) trace `x` is a tracer of, else None."""
    trace = _compat.trace_of(x)
    return trace if _compat.is_differentiation_trace(trace) else None


def _inner_values(leaves, trace) -> bool:
    """Whether a leaf is a tracer of a trace nested inside ``trace``: a loop body's own
    value (its carry or ``xs``, e.g. nn.scan's per-layer FP8 states beside weights the
    body closes over), whose differentiation is decided outside the body, unseen here."""
    for x in leaves:
        t = _compat.trace_of(x)
        while t is not None and t is not trace:
            t = _compat.parent_trace(t)
        if t is trace and _compat.trace_of(x) is not trace:
            return True
    return False


# An FP8 state differentiated outside a loop body that closes over it (a microbatch loop
# written inside the loss): {what}, {loop}.
CLOSED_OVER = (
    "{what} is differentiated but closed over by a `{loop}` body, so JAX would sum its "
    "amaxes over the iterations instead of taking their max. For microbatches "
    "differentiate inside the body and combine the FP8 gradients with "
    "jax_fp8.combine_fp8_grads (`loss, grads = state.value_and_grad(loss_fn)(x_i)` per "
    "iteration; docs/semantics.md, \"Gradient accumulation\"); or pass the state through "
    "the loop in its carry.")


def check_not_closed_over_by_loop(leaves, message: str) -> None:
    """Raises ValueError(``message`` with ``{loop}``) when a leaf is differentiated at a
    level outside a loop body that is being traced (the body closes over it: JAX would
    sum what the iterations hand back)."""
    for leaf in leaves:
        if _ad_trace(leaf) is None:
            continue
        loop = next((_compat.traced_for(t) for t in _chain(leaf) or []
                     if _compat.traced_for(t) in LOOPS), None)
        if loop is not None:
            raise ValueError(message.format(loop=loop))


def claim(meta, op: str, operands=()) -> None:
    """Trace-time checks of a delayed-scaling `meta` given to an FP8 op with ``operands``.

    * A differentiated meta (its leaves are tracers of ``grad``/``vjp``/``jvp``) must be
      used once: a second use of the same meta value, or a meta closed over by a loop
      body, would make JAX sum the amax cotangents; both raise ValueError. Metas that are
      not differentiated (inference) may be reused freely.
    * An operand differentiated at a level where the meta is not raises ValueError (the
      amaxes would be dropped: the scales would never change), except inside
      `frozen_scales`.

    What the checks cannot see: differentiation applied to a function that was traced
    before it (``jax.grad(jax.jit(f))``, ``jax.grad`` of a ``jax.checkpoint`` /
    ``nn.remat`` function), and FP8 ops inside a ``lax.scan`` / ``nn.scan`` / ``nnx.scan``
    or ``vmap`` body, whose values are the body's own tracers (a meta of the body's own
    beside weights it closes over, as in a weight-tied scan, included). There,
    ``Fp8TrainState.apply_gradients`` (which refuses to drop FP8 gradients) and
    `jax_fp8.flax.nnx.check_fp8_updated` remain.
    """
    if not scales_frozen():
        leaves = jax.tree.leaves(meta)
        meta_traces = {id(t) for t in map(_ad_trace, leaves) if t is not None}
        if any(t is not None and id(t) not in meta_traces and not _inner_values(leaves, t)
               for t in map(_ad_trace, operands)):
            raise ValueError(_DROPPED.format(op=op))
    for leaf in jax.tree.leaves(meta):
        if _ad_trace(leaf) is None:
            continue
        chain = _chain(leaf) or []
        loop = next((_compat.traced_for(t) for t in chain if _compat.traced_for(t) in LOOPS), None)
        if loop is not None:
            raise ValueError(_LOOP.format(op=op, loop=loop))
        top = chain[-1] if chain else None
        seen = _consumed.get(id(leaf))
        if seen is not None and seen[0]() is leaf:
            prev_top = seen[1]() if seen[1] is not None else None
            both_branches = (_compat.traced_for(top) in BRANCHES and
                             _compat.traced_for(prev_top) in BRANCHES)
            if not both_branches:  # the two branches of a cond never both run
                raise ValueError(_REUSE.format(op=op))
        key = id(leaf)
        def forget(_: weakref.ref, k: int = key) -> None:
            _consumed.pop(k, None)

        _consumed[key] = (weakref.ref(leaf, forget), None if top is None else weakref.ref(top))


def amax_cotangents(fp8_grads: Any) -> Any:
    """The observed amaxes carried by FP8 gradients, as float32 arrays: each `AmaxGrad`
    -> its amaxes, each raw ScalingState cotangent -> its staging slot.

    Raises:
      TypeError: an `AmaxGrad` that does not hold amaxes (rebuilt by generic tree code).
    """
    def amax(path, g):
        if isinstance(g, AmaxGrad):
            return g.value("fp8_grads" + jax.tree_util.keystr(path))
        return g.amax_history[..., 0] if is_state(g) else g

    return jax.tree_util.tree_map_with_path(amax, fp8_grads, is_leaf=_is_grad_leaf)


def unreduced_device_axes() -> tuple:
    """The mapped axes of a ``jax.pmap`` (or ``shard_map(check_vma=False)``) being traced:
    there JAX keeps no record of which values differ across devices, so the FP8 ops
    cannot max-reduce the amaxes of a replicated state, and each device observes its
    own. (Under ``shard_map`` with ``check_vma`` they do; those axes are not listed.)"""
    chain, t = [], _compat.current_trace()
    while t is not None:
        chain.append(_compat.traced_for(t))
        t = _compat.parent_trace(t)
    if "shard_map" not in chain:
        return ()
    return tuple(name for name in _compat.axis_names()
                 if name not in amax_lib.varying_axes(jax.lax.axis_index(name)))


def check_amaxes_reduced(axis_name: Hashable | None, where: str) -> None:
    """Raises ValueError inside ``jax.pmap`` without ``axis_name`` (the devices'
    amaxes would each update their own replica of the FP8 state, which then drift
    apart)."""
    if axis_name is not None or scales_frozen():
        return
    axes = unreduced_device_axes()
    if axes:
        raise ValueError(
            f"{where}: traced inside jax.pmap (or shard_map(check_vma=False)) over "
            f"{axes[0]!r}, where each device observes its own amaxes and would update its "
            f"replica of the FP8 state with them (the replicas drift apart). Pass "
            f"axis_name={axes[0]!r}: the update then takes the max over the devices (one "
            "pmax), as the rule for one batch. Average the parameter gradients with "
            "lax.pmean(grads['params'], ...) as usual; the FP8 gradients refuse pmean.")


def new_fp8_state(fp8_states: Any, fp8_grads: Any, recipe: recipe_lib.Recipe | None = None, *,
                  axis_name: Hashable | None = None, implementation: str = "auto") -> Any:
    """The step's new FP8 state: ONE `update_states` call for every state of the model.

    Args:
      fp8_states: any pytree of ScalingStates (e.g. Fp8Metas, a Flax collection, a
        `PackedStates`).
      fp8_grads: the FP8 gradients of ``fp8_states`` (same structure): an `AmaxGrad`
        per state as jax_fp8's value_and_grad functions return them, or JAX's raw
        cotangent (a ScalingState whose staging slot ``amax_history[..., 0]`` holds the
        amax observed this step), which must arrive unchanged.
      recipe: the recipe the states were made by (default ``DelayedScaling()``); every
        state's history length and FP8 dtype must be the ones it gives them, else
        ValueError (checked at trace time). A current or blockwise recipe keeps no state:
        ``fp8_states`` must then hold none, and is returned as is.
      axis_name: inside ``shard_map`` / ``pmap``, the axis (or axes) whose devices'
        amaxes are combined, with one ``pmax`` for all of them (see ``update_states``).

    Returns:
      ``fp8_states`` updated (same structure); traced inside `frozen_scales`,
      ``fp8_states`` as they are (the recipe is still checked).
    """
    recipe = recipe_lib.default() if recipe is None else recipe
    state_lib.check_states_follow(recipe, fp8_states, "fp8_states")
    if not recipe.keeps_state or scales_frozen():
        return fp8_states
    return update_states(fp8_states, amax_cotangents(fp8_grads), recipe=recipe,
                         axis_name=axis_name, implementation=implementation)


def check_fp8_updated(fp8_states: Any, name: str = "fp8_states") -> None:
    """Raises ValueError when the delayed-scaling states in ``fp8_states`` show a training
    loop that does not update them through the FP8 update:

    * every one is still as created (an all-zero amax history and scale 1): the loop
      never passes the FP8 gradients to the update, and trains with unit scales;
    * one holds a negative amax in its history, which no update writes: something else
      changed it, typically an optimizer that was given the FP8 state as parameters and
      applied its gradients (the observed amaxes) as updates.

    Call it on concrete values (outside ``jit``) after a few training steps.
    ``fp8_states``: any pytree of ScalingStates (an Fp8TrainState's ``fp8``, a
    `PackedStates`, a Flax collection, a whole Flax ``variables`` dict; NNX:
    `jax_fp8.flax.nnx.check_fp8_updated`).
    """
    leaves = jax.tree_util.tree_leaves_with_path(fp8_states, is_leaf=is_state)
    states = [(jax.tree_util.keystr(path), s) for path, s in leaves if is_state(s)]
    fix = ("Linen: `loss, grads = state.value_and_grad(loss_fn)(...)` and "
           "`state.apply_gradients(grads=grads)` with a `jax_fp8.flax.Fp8TrainState`; NNX: "
           "`loss, grads = jax_fp8.flax.nnx.fp8_value_and_grad(loss_fn)(model, ...)` and "
           "`jax_fp8.flax.nnx.apply_gradients(model, optimizer, grads, recipe)` (or "
           "`optimizer = jax_fp8.flax.nnx.Fp8Optimizer(model, tx, wrt=nnx.Param, "
           "recipe=recipe)` and `optimizer.update(model, grads)`), with `recipe` the one the "
           "layers were made with (linen: `Fp8TrainState.create(..., recipe=recipe)`).")
    negative = [where for where, s in states if np.any(np.asarray(s.amax_history) < 0)]
    if negative:
        shown = ", ".join(negative[:3]) + (f" and {len(negative) - 3} more" if len(negative) > 3
                                           else "")
        raise ValueError(
            f"{name}: delayed-scaling states with negative amaxes in their history ({shown}), "
            "which no FP8 update writes: something other than the FP8 update changed them, "
            "most likely an optimizer given the FP8 state as parameters (e.g. "
            "`flax.training.train_state.TrainState.create(params=variables)` with the FP8 "
            "collection inside `variables`) that applied its gradients, the observed amaxes, "
            "as updates. Keep the FP8 state out of the optimizer: " + fix)
    if states and all(not np.any(np.asarray(s.amax_history)) and
                      np.all(np.asarray(s.scale) == 1) for _, s in states):
        raise ValueError(
            f"{name}: none of its {len(state_lib.states_info(fp8_states))} delayed-scaling "
            "states was ever updated (zero amax histories, scale 1): the training loop does "
            "not pass the FP8 gradients to the update, and trains with unit scales, or "
            "every GEMM of these layers ran out of FP8, below its min_fp8_flops (fp8_model's "
            "default min_fp8_flops='auto' keeps GEMMs too small for FP8 to pay; "
            "`jax_fp8.devtools.explain` lists them; Fp8Rule(min_fp8_flops=0) converts "
            "every GEMM). " + fix)


def combine_fp8_grads(*fp8_grads: Any) -> Any:
    """Combines the FP8 gradients of several microbatches (or steps) by max, never sum.

    Each may hold `AmaxGrad`s or raw ScalingState cotangents (an accumulator started as
    ``jax.tree.map(jnp.zeros_like, state.fp8)`` or ``jax.tree.map(jnp.zeros_like, grads)``
    included); the result has the representation of the first (so a ``lax.scan`` carry
    keeps its type).
    """
    if not fp8_grads:
        raise ValueError("combine_fp8_grads needs at least one gradient tree")

    def amax(g):
        return g.value("combine_fp8_grads") if isinstance(g, AmaxGrad) else \
            g.amax_history[..., 0]

    def combine(*gs):
        first = gs[0]
        if not _is_grad_leaf(first):
            return first
        staged = functools.reduce(jnp.fmax, [amax(g) for g in gs])
        if isinstance(first, AmaxGrad):
            return AmaxGrad.of(staged)
        return ScalingState(jnp.zeros_like(first.amax_history).at[..., 0].set(staged),
                            jnp.zeros_like(first.scale), jnp.zeros_like(first.scale_inv),
                            fp8_dtype=first.fp8_dtype)

    return jax.tree.map(combine, *fp8_grads, is_leaf=_is_grad_leaf)
