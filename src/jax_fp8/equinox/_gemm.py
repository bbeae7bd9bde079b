"""The FP8 GEMM of an Equinox layer: one call per example, one GEMM per ``jax.vmap`` batch.

Equinox layers are written for one example and called under ``jax.vmap``. Batched by
JAX's own rules, an `fp8_dot_general` of a per-example input and a shared kernel would
judge ``min_fp8_flops`` on one example's GEMM, and its kernel gradient would be one GEMM
per example summed afterwards. Here, under a ``jax.vmap`` that batches the input alone
(the kernel and the FP8 state shared by the batch), the vmapped axis becomes one more
free axis of the input (`jax.custom_batching.custom_vmap`): the FP8 op sees the batched
GEMM, its amaxes are those of the whole batch (the max over its examples), the
``min_fp8_flops`` threshold counts its FLOPs, and its kernel gradient contracts over the
batch in one GEMM. Any other batching (a batched kernel or state: ``vmap`` over stacked
layers) is the FP8 op's own.
"""

from __future__ import annotations

import string
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jax_fp8 import _compat, interception
from jax_fp8.gemm.dot_general import check_min_fp8_flops, fp8_dot_general
from jax_fp8.gemm.einsum import fp8_einsum
from jax_fp8.meta import Fp8Meta

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["fp8_gemm"]


def fp8_gemm(kind: str, spec: Any, lhs: ArrayLike, rhs: ArrayLike, meta: Fp8Meta, *,
             precision: Any = None, preferred_element_type: Any = None,
             min_fp8_flops: float | str = 0.0) -> tuple[jax.Array, Fp8Meta]:
    """``(out, meta)`` of the FP8 GEMM ``kind`` ("dot_general": ``spec`` its dimension
    numbers; "einsum": ``spec`` its two-operand equation), ``rhs`` quantized as the
    kernel; under ``jax.vmap`` one GEMM over the batch (module docstring).

    An Equinox layer cannot keep the meta its GEMM returns, so a layer called twice in
    one differentiated computation (a shared layer) would hand the same meta to two FP8
    ops, whose amaxes JAX would sum. The meta a call returns is therefore recorded
    against the one it was given, and a later call given that meta again, in the same
    computation, uses the recorded one: the uses are threaded and their amaxes combine
    by max (`jax_fp8.meta`)."""
    static = (kind, spec, precision, preferred_element_type, check_min_fp8_flops(min_fp8_flops))
    given = meta
    meta = _threaded(meta)
    out, new = _gemm(static, lhs, rhs, meta)
    _record(given, new)
    return out, new


# The meta returned by the last use of a meta value (differentiated, a tracer): id of its
# first leaf -> (weak reference to that leaf, the returned meta).
_last_use: dict[int, tuple[weakref.ref[Any], Fp8Meta]] = {}


def _key_leaf(meta: Fp8Meta) -> jax.core.Tracer[Any] | None:
    leaves = jax.tree.leaves(meta)
    return leaves[0] if leaves and isinstance(leaves[0], jax.core.Tracer) else None


def _visible(meta: Fp8Meta) -> bool:
    """Whether ``meta``'s values belong to the trace being traced now or one it is
    nested in (a value of a finished inner trace, e.g. a ``vmap`` body, is not)."""
    own = {id(_compat.trace_of(x)) for x in jax.tree.leaves(meta)} - {id(None)}
    t = _compat.current_trace()
    while t is not None and own:
        own.discard(id(t))
        t = _compat.parent_trace(t)
    return not own


def _threaded(meta: Fp8Meta) -> Fp8Meta:
    leaf = _key_leaf(meta)
    if leaf is None:
        return meta
    found = _last_use.get(id(leaf))
    if found is None or found[0]() is not leaf or not _visible(found[1]):
        return meta
    return found[1]


def _record(given: Fp8Meta, new: Fp8Meta) -> None:
    leaf = _key_leaf(given)
    if leaf is None:
        return
    key = id(leaf)

    def forget(_: Any, k: int = key) -> None:
        _last_use.pop(k, None)

    _last_use[key] = (weakref.ref(leaf, forget), new)


def _plain(static: tuple[Any, ...], lhs: ArrayLike, rhs: ArrayLike, meta: Fp8Meta
           ) -> tuple[jax.Array, Fp8Meta]:
    kind, spec, precision, preferred_element_type, min_fp8_flops = static
    # The FP8 op's own GEMMs are never converted again by an enclosing converted module.
    with interception.running(None):
        if kind == "dot_general":
            return fp8_dot_general(lhs, rhs, spec, meta, precision, preferred_element_type,
                                   min_fp8_flops=min_fp8_flops)
        return fp8_einsum(spec, lhs, rhs, meta, preferred_element_type=preferred_element_type,
                          min_fp8_flops=min_fp8_flops)


def _with_batch_axis(static: tuple[Any, ...]) -> tuple[tuple[Any, ...], int]:
    """``static`` for an input with one more leading axis, and where that axis lands in
    the result."""
    kind, spec, *rest = static
    if kind == "dot_general":
        (lc, rc), (lb, rb) = spec
        shift: Callable[[Sequence[Any]], tuple[int, ...]] = \
            lambda axes: tuple(int(a) + 1 for a in axes)  # noqa: E731
        # dot_general's result is (batch axes, lhs free axes, rhs free axes).
        return (kind, ((shift(lc), tuple(rc)), (shift(lb), tuple(rb))), *rest), len(lb)
    # An explicit equation ("ab,bc->ac"; the interception spells its GEMMs so).
    eqn = spec.replace(" ", "")
    ins, out = eqn.split("->")
    a, b = ins.split(",")
    letter = next(c for c in string.ascii_letters if c not in eqn)
    return (kind, f"{letter}{a},{b}->{letter}{out}", *rest), 0


def _gemm(static: tuple[Any, ...], lhs: ArrayLike, rhs: ArrayLike, meta: Fp8Meta
          ) -> tuple[jax.Array, Fp8Meta]:
    if not _compat.batched_here(lhs):
        return _plain(static, lhs, rhs, meta)

    @jax.custom_batching.custom_vmap
    def gemm(lhs: jax.Array, rhs: jax.Array, meta: Fp8Meta) -> tuple[jax.Array, Fp8Meta]:
        return _plain(static, lhs, rhs, meta)

    @gemm.def_vmap
    def rule(axis_size: int, in_batched: Sequence[Any], lhs: jax.Array, rhs: jax.Array,
             meta: Fp8Meta) -> tuple[tuple[jax.Array, Fp8Meta], tuple[bool, Any]]:
        del axis_size
        lhs_batched, rhs_batched, meta_batched = in_batched
        meta_flags, treedef = jax.tree.flatten(meta_batched)
        if lhs_batched and not rhs_batched and not any(meta_flags):
            # The batch as one more free axis of the input: one GEMM, its amaxes and
            # FLOPs those of the batch (nested vmaps fold one axis each).
            folded, position = _with_batch_axis(static)
            out, new_meta = _gemm(folded, lhs, rhs, meta)
            return ((jnp.moveaxis(out, position, 0), new_meta),
                    (True, jax.tree.map(lambda _: False, new_meta)))
        # A batched kernel or state (stacked layers): the FP8 op's own batching.
        meta_leaves = jax.tree.leaves(meta)

        def one(lhs: jax.Array, rhs: jax.Array, leaves: list[Any]
                ) -> tuple[jax.Array, list[Any]]:
            out, new = _plain(static, lhs, rhs, jax.tree.unflatten(treedef, leaves))
            return out, jax.tree.leaves(new)

        axes = [0 if b else None for b in meta_flags]
        out, new_leaves = jax.vmap(one, in_axes=(0 if lhs_batched else None,
                                                 0 if rhs_batched else None, axes),
                                   out_axes=(0, axes))(lhs, rhs, meta_leaves)
        return ((out, jax.tree.unflatten(treedef, new_leaves)),
                (True, jax.tree.unflatten(treedef, meta_flags)))

    return cast("tuple[jax.Array, Fp8Meta]", gemm(lhs, rhs, meta))
