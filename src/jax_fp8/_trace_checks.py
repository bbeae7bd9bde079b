"""Trace-time checks of how FP8 state is used, and `frozen_scales`, which opts out of them.

An FP8 op's amaxes leave a train step as the cotangent of its `Fp8Meta`
(`jax_fp8.meta`), and JAX sums cotangents where the rule is max. `claim` refuses, at
trace time, the uses where that would happen or where the amaxes would be dropped: one
meta value given to two ops, a meta closed over by a loop body, operands differentiated
without their meta. `check_amaxes_reduced` refuses an FP8 update inside ``pmap`` whose
devices' amaxes would not be combined. Inside `frozen_scales` no scale changes, and the
checks that guard the update stand down.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import jax

from jax_fp8 import _compat, _hints
from jax_fp8._primitives import amax as amax_lib

# What a staging trace of a loop body traces for (`_compat.traced_for`).
LOOPS = ("scan", "fori_loop", "while_body", "while_cond", "while_loop")
BRANCHES = ("cond", "switch")
# Tracers already handed to an FP8 op as (part of) a meta: id -> (tracer, trace under it).
_consumed: dict[int, tuple[weakref.ref[Any], weakref.ref[Any] | None]] = {}


def _chain(leaf: Any) -> list[Any] | None:
    """The traces between the current one and `leaf`'s own, innermost first (None when
    `leaf`'s trace is not an ancestor of the current one)."""
    t, chain, own = _compat.current_trace(), [], _compat.trace_of(leaf)
    while t is not None and t is not own:
        chain.append(t)
        t = _compat.parent_trace(t)
    return chain if t is not None else None


def _reuse(op: str) -> str:
    hints = _hints.of_caller()
    return (f"{op}: this Fp8Meta was already given to another FP8 op in the same "
            "computation, so their amaxes would be summed instead of maxed. Thread it: "
            f"`out, meta = {op}(..., meta)` and pass the returned meta to the next use "
            "(jax_fp8's layers do this). Two applications of one model on the same FP8 "
            "state in one differentiated function are such a second use: apply it once "
            f"(e.g. on the inputs concatenated){hints.reuse}. For several microbatches "
            "differentiate each and use combine_fp8_grads.")


def _loop(op: str, loop: str) -> str:
    scan = _hints.of_caller().scan
    return (f"{op}: this Fp8Meta is differentiated but closed over by a `{loop}` body, so "
            "JAX would sum its amaxes over the iterations instead of taking their max. Pass "
            "it through the loop instead: in the carry (and return the threaded meta from "
            "the body), or one meta per iteration as `xs`" + (f" ({scan})" if scan else "")
            + ".")


def _dropped(op: str) -> str:
    hints = _hints.of_caller()
    return (f"{op}: its operands are being differentiated but its delayed-scaling Fp8Meta "
            "is not, so the amaxes it observes would be dropped and its scales would never "
            f"change. Differentiate the FP8 state too: {hints.loop}. To keep the scales "
            "frozen on purpose (e.g. gradients w.r.t. the inputs only), trace under "
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
    * `new_fp8_state` returns the states unchanged, and the adapters' training step
      (`jax_fp8._training_step`: `Fp8TrainState.apply_gradients`, NNX `apply_gradients` /
      `update_fp8` / `Fp8Optimizer.update`, Equinox `apply_updates`) steps the optimizer
      on the parameters and leaves the FP8 state (and, under ``optax.MultiSteps``, its
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


def _ad_trace(x: Any) -> Any:
    """The differentiation (JVP / linearize) trace `x` is a tracer of, else None."""
    trace = _compat.trace_of(x)
    return trace if _compat.is_differentiation_trace(trace) else None


def _inner_values(leaves: Iterable[Any], trace: Any) -> bool:
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
    "differentiate inside the body (one gradient per iteration) and combine the FP8 "
    "gradients with jax_fp8.combine_fp8_grads (docs/semantics.md, \"Gradient "
    "accumulation\"); or pass the state through the loop in its carry.")


def check_not_closed_over_by_loop(leaves: Iterable[Any], message: str) -> None:
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


def claim(meta: Any, op: str, operands: Iterable[Any] = ()) -> None:
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
            raise ValueError(_dropped(op))
    for leaf in jax.tree.leaves(meta):
        if _ad_trace(leaf) is None:
            continue
        chain = _chain(leaf) or []
        loop = next((_compat.traced_for(t) for t in chain if _compat.traced_for(t) in LOOPS), None)
        if loop is not None:
            raise ValueError(_loop(op, loop))
        top = chain[-1] if chain else None
        seen = _consumed.get(id(leaf))
        if seen is not None and seen[0]() is leaf:
            prev_top = seen[1]() if seen[1] is not None else None
            both_branches = (_compat.traced_for(top) in BRANCHES and
                             _compat.traced_for(prev_top) in BRANCHES)
            if not both_branches:  # the two branches of a cond never both run
                raise ValueError(_reuse(op))
        key = id(leaf)
        def forget(_: weakref.ref[Any], k: int = key) -> None:
            _consumed.pop(k, None)

        _consumed[key] = (weakref.ref(leaf, forget), None if top is None else weakref.ref(top))


def unreduced_device_axes() -> tuple[Any, ...]:
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


def check_amaxes_reduced(axis_name: Hashable | None, hints: _hints.StepHints) -> None:
    """Raises ValueError inside ``jax.pmap`` without ``axis_name`` (the devices'
    amaxes would each update their own replica of the FP8 state, which then drift
    apart); the message names ``hints.call`` and the framework's parameter gradients."""
    if axis_name is not None or scales_frozen():
        return
    axes = unreduced_device_axes()
    if axes:
        raise ValueError(
            f"{hints.call}: traced inside jax.pmap (or shard_map(check_vma=False)) over "
            f"{axes[0]!r}, where each device observes its own amaxes and would update its "
            f"replica of the FP8 state with them (the replicas drift apart). Pass "
            f"axis_name={axes[0]!r}: the update then takes the max over the devices (one "
            f"pmax), as the rule for one batch. Average {hints.param_grads} with "
            "lax.pmean as usual; the FP8 gradients refuse pmean.")
