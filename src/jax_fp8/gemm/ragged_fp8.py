"""`fp8_ragged_dot`: ``jax.lax.ragged_dot`` (a mixture-of-experts layer's grouped GEMM) with FP8
operands and a custom VJP, for any recipe.

Here the call is only checked and canonicalised (the operands, ``group_sizes``, the result
dtype, a GEMM kept out of FP8 below ``min_fp8_flops``); the G GEMMs are the meta's
recipe's (``recipe.ragged_dot``, each recipe in its module under ``jax_fp8.recipes``; the
machinery they share in ``jax_fp8.gemm._grouped``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import _compat
from jax_fp8.gemm import _grouped
from jax_fp8.gemm.dot_general import check_meta, check_min_fp8_flops, kept_out
from jax_fp8.gemm.ragged import ragged_dot
from jax_fp8.meta import Fp8Meta

__all__ = ["fp8_ragged_dot", "fp8_ragged_dot_general", "ragged_dot_flops"]

_OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def ragged_dot_flops(lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> int:
    """2 * M * K * N: the FLOPs of ``lax.ragged_dot(lhs [M, K], rhs [G, K, N])`` (each row
    multiplied by one expert's weight)."""
    m, k = lhs_shape
    return 2 * int(m) * int(k) * int(rhs_shape[-1])


def fp8_ragged_dot(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike, meta: Fp8Meta, *,
                   precision: Any = None, preferred_element_type: DTypeLike | None = None,
                   group_offset: ArrayLike | None = None, min_fp8_flops: float | str = 0,
                   ) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``jax.lax.ragged_dot``; returns ``(out, meta)``.

    Shapes are ``lax.ragged_dot``'s: lhs [M, K] (the tokens, sorted by expert), rhs
    [G, K, N] (one weight per expert), group_sizes integer [G] -> out [M, N]: rows
    ``[offset_g, offset_g + size_g)`` are multiplied by ``rhs[g]``; rows past
    ``sum(group_sizes)`` are 0. The sizes are clamped in order (a negative size counts as
    0, a group reaching past row M is cut there), as the grouped GEMM primitive does.

    It is **G GEMMs, each with the FP8 tensors a GEMM has** (docs/moe.md):

    * delayed scaling: ``meta = Fp8Meta.create(DelayedScaling(...), shape=(G,))``, one
      state per expert for the input, the weight and the gradient (leading axis G, all
      updated by the one fused `jax_fp8.new_fp8_state`). Group g's rows are quantized with
      ``meta.input.scale[g]``, expert g's weight with ``meta.kernel.scale[g]``, the
      gradient's rows with ``meta.grad.scale[g]``; the amaxes observed (the gradient w.r.t.
      ``meta``) are per group of rows (0 for an empty group) and per expert;
    * current scaling: one scale per group of rows and per expert, from its own amax;
    * block scaling / MXFP8: 1-D blocks along K of each row (never crossing a group), each
      expert's weight its own 128 x 128 tiles (MXFP8: 1 x 32 blocks); the weight gradient's
      blocks along the tokens start at each group's first row and end at its last.

    The forward product and the input gradient of delayed and current scaling are the
    grouped FP8 GEMM primitive (a CUTLASS kernel on SM90 GPUs); the weight gradient
    (ragged along the tokens, its contraction) is a float32-accumulated
    ``ragged_dot_general`` of the FP8 operands; block scaling and MXFP8 multiply the
    operands dequantized per block in float32 (the block GEMM reference's numbers).
    Differentiable once, as `jax_fp8.fp8_dot_general` (the same meta threading rules);
    ``group_sizes`` gets no gradient. Under ``jax.vmap`` it raises NotImplementedError
    (as ``jax.lax.ragged_dot`` does): merge the batch into the tokens, or ``jax.lax.map``.

    Args:
      precision: ignored (FP8 GEMMs have one precision), except by a GEMM kept out of FP8.
      preferred_element_type: bfloat16, float16 or float32 (default: the operands' result
        type).
      group_offset: not supported, as in ``jax.lax.ragged_dot`` (NotImplementedError).
      min_fp8_flops: below this many forward FLOPs (`ragged_dot_flops`, ``2 * M * K * N``),
        or with ``"measured"`` where FP8 is not faster at these sizes (`jax_fp8.fp8_pays`),
        the product runs as `jax_fp8.ragged_dot` (the bf16 grouped kernel on a GPU) in the
        operands' dtype and ``meta`` comes back untouched.

    Example:

        meta = jax_fp8.Fp8Meta.create(jax_fp8.DelayedScaling(), shape=(num_experts,))
        out, meta = jax_fp8.fp8_ragged_dot(x_sorted, w_experts, group_sizes, meta)
    """
    if group_offset is not None:
        raise NotImplementedError("fp8_ragged_dot: group_offset is not supported (nor is it "
                                  "by jax.lax.ragged_dot); slice rhs and group_sizes to the "
                                  "local experts instead")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    sizes = _grouped.check_operands(lhs, rhs, jnp.asarray(group_sizes))
    if any(_compat.batched_here(a) for a in (lhs, rhs, sizes, *jax.tree.leaves(meta))):
        raise NotImplementedError(
            "fp8_ragged_dot under jax.vmap: a grouped GEMM has no batching rule (nor has "
            "jax.lax.ragged_dot). Merge the batch into the token axis (every example's "
            "tokens sorted by expert, one group_sizes) or map over it with jax.lax.map")
    recipe = check_meta(meta, "meta", shape=(rhs.shape[0],))
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else jnp.result_type(lhs, rhs))
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"fp8_ragged_dot: preferred_element_type must be bfloat16, float16 or "
                        f"float32, got {out_dtype}")
    kept = kept_out(recipe, check_min_fp8_flops(min_fp8_flops), lhs.shape[0], lhs.shape[1],
                    rhs.shape[-1])
    if kept is not None:   # the bf16 grouped GEMM (a grouped kernel on a GPU)
        dtype = jnp.result_type(lhs, rhs)
        with jax.named_scope(kept[0]):   # what jax_fp8.devtools.explain reads
            out = ragged_dot(lhs.astype(dtype), rhs.astype(dtype), sizes,
                             precision=precision, preferred_element_type=out_dtype)
        return out, meta
    return recipe.ragged_dot(lhs, rhs, sizes, meta, out_dtype)


_MOE_NUMBERS = "lhs [M, K] ragged along M, rhs [G, K, N] or [G, N, K] grouped along its axis 0"


def fp8_ragged_dot_general(lhs: ArrayLike, rhs: ArrayLike, group_sizes: ArrayLike,
                           ragged_dot_dimension_numbers: lax.RaggedDotDimensionNumbers,
                           meta: Fp8Meta, *, precision: Any = None,
                           preferred_element_type: DTypeLike | None = None,
                           group_offset: ArrayLike | None = None,
                           min_fp8_flops: float | str = 0,
                           ) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``jax.lax.ragged_dot_general`` in the forms mixture-of-experts layers use: lhs
    [M, K] ragged along its rows, rhs grouped along axis 0 as [G, K, N] or [G, N, K]
    (``fp8_ragged_dot`` on rhs with its last two axes in that order); other dimension
    numbers raise NotImplementedError. Returns ``(out [M, N], meta)``."""
    rhs = jnp.asarray(rhs)
    numbers = ragged_dot_dimension_numbers
    (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
    lc, rc, lb, rb = (tuple(int(a) for a in axes) for axes in (lc, rc, lb, rb))
    form = (lc, lb, rb, tuple(numbers.lhs_ragged_dimensions),
            tuple(numbers.rhs_group_dimensions))
    if jnp.ndim(lhs) != 2 or rhs.ndim != 3 or form != ((1,), (), (), (0,), (0,)) \
            or rc not in ((1,), (2,)):
        raise NotImplementedError(f"fp8_ragged_dot_general takes the mixture-of-experts form "
                                  f"({_MOE_NUMBERS}), got {numbers}")
    if rc == (2,):
        rhs = jnp.swapaxes(rhs, 1, 2)
    return fp8_ragged_dot(lhs, rhs, group_sizes, meta, precision=precision,
                          preferred_element_type=preferred_element_type,
                          group_offset=group_offset, min_fp8_flops=min_fp8_flops)
