"""The GEMMs of one `jax_fp8.fp8_ragged_dot` (a mixture-of-experts layer's G GEMMs), shared by
the recipes (docs/moe.md; ../shared/SPEC.md, "Grouped GEMMs").

Shapes: lhs [M, K] (tokens sorted by expert), rhs [G, K, N] (one weight per expert), the
groups as the grouped GEMM primitive clamps them (`clamped_group_ends`: negative sizes
count as 0, a group reaching past row M is cut there; rows past the last group belong to
none). Three GEMMs, each G GEMMs:

  forward  out_g  = lhs_g . rhs[g]        ragged along M (the rows)
  dgrad    dlhs_g = grad_g . rhs[g]^T     ragged along M
  wgrad    drhs[g] = lhs_g^T . grad_g     ragged along the contraction (the rows)

Per-group scaled recipes (one scale per group of rows, one per expert: delayed and current
scaling) run the forward and dgrad as the grouped FP8 GEMM primitive
(`_primitives.grouped_gemm`, a CUTLASS kernel on SM90) and the wgrad as the grouped
weight-gradient primitive (`_primitives.grouped_wgrad`: a float32-accumulated
``ragged_dot_general`` of the FP8 operands, `ragged_contract`, or a CUTLASS kernel on SM90
where switched on). Blocked recipes (block
scaling, MXFP8) run each as the float32 product of the operands dequantized per block
(`Blocks`), the block GEMM reference's numbers, with the token-axis blocks of the wgrad cut
at group boundaries (`token_quantize`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import grouped_gemm as gg, grouped_wgrad as gw
from jax_fp8._primitives.exact import U32, abs_bits, from_bits, to_bits, widen

_MAG = U32(0x7FFFFFFF)

clamped_group_ends = gg.clamped_group_ends
row_groups = gg.row_groups


def group_sizes_of(ends: jax.Array) -> jax.Array:
    """The clamped sizes (int32 [G]) of the groups ending at `ends`."""
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


# ----------------------------------------------------------------------------- amaxes

def _mag_bits(x: jax.Array) -> jax.Array:
    """The bits of |x| in float32 (NaN kept: its bits exceed every number's)."""
    return cast(jax.Array, to_bits(widen(x)) & _MAG)


def group_amax(x: jax.Array, group: jax.Array, groups: int) -> jax.Array:
    """max |x| over each group's rows (float32 [G]): 0 for an empty group, NaN where a row
    of the group holds a NaN (as a tensor's amax on the GPU), rows of group G (past the
    last group) left out. Taken on the bits of |x|, so every backend gives these bits."""
    row_max = jnp.max(_mag_bits(x), axis=tuple(range(1, x.ndim)), initial=U32(0))
    # (segment_max of an empty segment is uint32's smallest value, 0: the bits of 0.0)
    per_group = jax.ops.segment_max(row_max, group, num_segments=groups + 1,
                                    indices_are_sorted=True)[:groups]
    return from_bits(per_group)


def expert_amax(w: jax.Array) -> jax.Array:
    """max |w[g]| for each expert g of w [G, ...] (float32 [G]), as `group_amax`."""
    return from_bits(jnp.max(_mag_bits(w), axis=tuple(range(1, w.ndim)), initial=U32(0)))


def rows_of(values: jax.Array, group: jax.Array) -> jax.Array:
    """values [G] per row (the last group's for rows past the groups)."""
    return values[jnp.minimum(group, values.shape[0] - 1)]


# ------------------------------------------------------------------------------ GEMMs

ragged_contract = gw.ragged_contract


def scaled_wgrad(q_a: jax.Array, q_b: jax.Array, ends: jax.Array, scale_inv_a: jax.Array,
                 scale_inv_b: jax.Array, out_dtype: DTypeLike) -> jax.Array:
    """drhs[g] = (sum over group g's rows of q_a^T q_b, float32) * (scale_inv_a[g] *
    scale_inv_b[g]) rounded once to out_dtype: the grouped weight-gradient primitive
    (`_primitives.grouped_wgrad`: a CUTLASS kernel on SM90 where switched on, its reference
    elsewhere)."""
    return gw.grouped_wgrad(q_a, q_b, group_sizes_of(ends), scale_inv_a, scale_inv_b,
                            out_dtype=out_dtype)


def grouped(q_lhs: jax.Array, q_rhs_t: jax.Array, ends: jax.Array, scale_inv_lhs: jax.Array,
            scale_inv_rhs: jax.Array, out_dtype: DTypeLike) -> jax.Array:
    """The grouped FP8 GEMM primitive: q_lhs [M, K] . q_rhs_t[g] [N, K]^T per group."""
    return gg.grouped_gemm(q_lhs, q_rhs_t, group_sizes_of(ends), scale_inv_lhs,
                           scale_inv_rhs, out_dtype=out_dtype)


# ------------------------------------------------------------------- blocked recipes

@dataclasses.dataclass(frozen=True)
class Blocks:
    """How a blocked recipe (block scaling, MXFP8) quantizes the operands of a grouped GEMM.

    Attributes:
      block: the length of a 1-D block (values along one axis sharing a scale).
      quantize: ``(a [..., R, C], role, fp8_dtype) -> (q, scale_inv)``, blocks along C,
        the recipe's block shape for ``role`` ("x", "w" or "grad"); leading axes independent.
      dequantize: ``(q, scale_inv, role) -> float32`` (q's shape), its inverse.
      elements: ``(x float32, amax float32, fp8_dtype) -> (q, scale_inv)`` elementwise
        (broadcast): x quantized with the scale of a block whose amax is ``amax``.
      dequantize_elements: ``(q, scale_inv) -> float32`` elementwise (broadcast).
    """

    block: int
    quantize: Callable[..., tuple[Any, Any]]
    dequantize: Callable[..., Any]
    elements: Callable[..., tuple[Any, Any]]
    dequantize_elements: Callable[..., Any]


def token_blocks(ends: jax.Array, m: int, block: int) -> tuple[jax.Array, int]:
    """(segment of each row int32 [m], number of segments S): the 1-D blocks of `block`
    rows along the token axis, each group's starting at its first row and the last one cut
    short at its last, so no block holds two groups' rows. Rows past the last group are in
    segment S (of no block). S = ceil(m / block) + G bounds the blocks of any sizes."""
    groups = ends.shape[0]
    segments = -(-m // block) + groups
    group = row_groups(ends, m)
    starts = ends - group_sizes_of(ends)
    counts = -(-group_sizes_of(ends) // block)
    first = jnp.cumsum(counts) - counts
    rows = jnp.arange(m, dtype=jnp.int32)
    pos = rows - rows_of(starts, group)
    seg = jnp.where(group < groups, rows_of(first, group) + pos // block, segments)
    return seg.astype(jnp.int32), segments


def token_quantize(blocks: Blocks, x: jax.Array, ends: jax.Array,
                   fp8_dtype: DTypeLike) -> tuple[Any, Any, jax.Array]:
    """x [M, C] quantized in 1-D blocks along its token axis M that never cross a group
    boundary (`token_blocks`): (q [M, C], scale_inv [S + 1, C] per block, segment [M]).
    A block's amax is fmaxf(0, |x_i|...) over its values (NaN ignored)."""
    x32 = widen(x)
    seg, segments = token_blocks(ends, x.shape[0], blocks.block)
    # (an empty segment's max is uint32's smallest value, 0: the bits of 0.0)
    amax = from_bits(jax.ops.segment_max(abs_bits(x32), seg, num_segments=segments + 1,
                                         indices_are_sorted=True))
    q, _ = blocks.elements(x32, amax[seg], fp8_dtype)
    _, scale_inv = blocks.elements(jnp.zeros_like(amax), amax, fp8_dtype)
    return q, scale_inv, seg


def token_dequantize(blocks: Blocks, q: jax.Array, scale_inv: jax.Array,
                     seg: jax.Array) -> Any:
    return blocks.dequantize_elements(q, scale_inv[seg])


# The name scope of a blocked recipe's grouped GEMMs (what jax_fp8.devtools.explain reads).
EMULATED_SCOPE = "grouped_blocks_emulated"
recipe_lib.GEMM_SCOPES[EMULATED_SCOPE] = (
    "blocks emulated", lambda: ("block-scaled grouped GEMM (block scaling / MXFP8): each "
                                "operand dequantized per block, one float32 ragged_dot"))


def blocked_forward(blocks: Blocks, fwd_dtype: DTypeLike, x: jax.Array, w: jax.Array,
                    ends: jax.Array, out_dtype: DTypeLike,
                    keep: bool) -> tuple[jax.Array, Any]:
    """out [M, N] of x [M, K] . w[g] [K, N] per group, and the backward's residuals."""
    with jax.named_scope(EMULATED_SCOPE):
        return _blocked_forward(blocks, fwd_dtype, x, w, ends, out_dtype, keep)


def _blocked_forward(blocks: Blocks, fwd_dtype: DTypeLike, x: jax.Array, w: jax.Array,
                     ends: jax.Array, out_dtype: DTypeLike,
                     keep: bool) -> tuple[jax.Array, Any]:
    qx, sx = blocks.quantize(x, "x", fwd_dtype)                      # blocks along K
    qw, sw = blocks.quantize(jnp.swapaxes(w, 1, 2), "w", fwd_dtype)  # [G, N, K]
    acc = gg.ragged_product(blocks.dequantize(qx, sx, "x"), blocks.dequantize(qw, sw, "w"),
                            ends, precision=lax.Precision.HIGHEST)
    out = acc.astype(out_dtype)
    if not keep:
        return out, None
    qw_kn, sw_kn = blocks.quantize(w, "w", fwd_dtype)                # [G, K, N], along N
    x_tokens = token_quantize(blocks, x, ends, fwd_dtype)            # along M, per group
    return out, (x_tokens, qw_kn, sw_kn)


def blocked_backward(blocks: Blocks, bwd_dtype: DTypeLike, residuals: Any, g: jax.Array,
                     ends: jax.Array, x_dtype: DTypeLike,
                     w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """(dx [M, K], dw [G, K, N]) for the output gradient g [M, N]."""
    with jax.named_scope(EMULATED_SCOPE):
        return _blocked_backward(blocks, bwd_dtype, residuals, g, ends, x_dtype, w_dtype)


def _blocked_backward(blocks: Blocks, bwd_dtype: DTypeLike, residuals: Any, g: jax.Array,
                      ends: jax.Array, x_dtype: DTypeLike,
                      w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    (qx_t, sx_t, seg), qw_kn, sw_kn = residuals
    qg, sg = blocks.quantize(g, "grad", bwd_dtype)                   # blocks along N
    dx = gg.ragged_product(blocks.dequantize(qg, sg, "grad"),
                           blocks.dequantize(qw_kn, sw_kn, "w"), ends,
                           precision=lax.Precision.HIGHEST)
    qg_t, sg_t, _ = token_quantize(blocks, g, ends, bwd_dtype)      # along M, per group
    dw = ragged_contract(token_dequantize(blocks, qx_t, sx_t, seg),
                         token_dequantize(blocks, qg_t, sg_t, seg), ends,
                         precision=lax.Precision.HIGHEST)
    return dx.astype(x_dtype), dw.astype(w_dtype)


def check_operands(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lhs [M, K] and rhs [G, K, N] floating, group_sizes integer [G] (as int32)."""
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if np.dtype(x.dtype) not in (np.dtype(np.float32), np.dtype(jnp.bfloat16),
                                     np.dtype(np.float16)):
            raise TypeError(f"fp8_ragged_dot: {name} must be float32, bfloat16 or float16, "
                            f"got {x.dtype}")
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"fp8_ragged_dot: need lhs [M, K] and rhs [G, K, N] (as "
                         f"jax.lax.ragged_dot), got lhs {list(lhs.shape)} and rhs "
                         f"{list(rhs.shape)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer) or \
            group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"fp8_ragged_dot: group_sizes must be an integer array of shape "
                         f"[G] = [{rhs.shape[0]}] (one size per expert of rhs), got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    if lhs.shape[0] > 2 ** 31 - 1:
        raise ValueError(f"fp8_ragged_dot: M = {lhs.shape[0]} rows exceed int32 group sizes")
    return group_sizes.astype(jnp.int32)
