"""Blockwise FP8 quantization (docs/semantics.md): each 1x128 block or 128x128 tile of a tensor
scaled from its own amax.

The numbers (docs/semantics.md, "Current and blockwise scaling"): a block's amax is
``fmaxf(0, |x_1|, ..., |x_n|)`` (NaN ignored), its scale Transformer Engine's
``compute_scale_from_amax`` (``scale_from_amax``, shared with current scaling in
``jax_fp8.quantization.current``), ``x_fp8 = saturate_cast(x * s)`` and ``scale_inv = 1 / s``, all
IEEE float32 with subnormals kept. The CUDA kernel (ffi/block_quantize_cuda.cu) and the
jax.numpy path give the same bits; a NaN x becomes the FP8 type's quiet NaN with x's
sign (0x7F/0xFF for E4M3, 0x7E/0xFE for E5M2). Per-tensor current scaling
(``quantize_current``) lives in ``jax_fp8.quantization.current`` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jax_fp8._primitives import block_gemm as gemm_lib, block_quantize as bq
from jax_fp8.quantization.current import (  # noqa: F401
    _operand,
    _options,
    quantize_current,
    scale_from_amax,
    scale_inverse,
)

__all__ = ["dequantize_blocks", "quantize_blocks", "quantize_blocks_both",
           "quantize_blocks_transposed", "quantize_current", "scale_from_amax", "scale_inverse"]

BLOCK_SHAPES = ((1, 128), (128, 128))


def _is_int(b: Any) -> bool:
    return isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_))


def _block_rows(block_shape: Any) -> int:
    """bm of block_shape (bm, 128); anything but the tuple or list of two ints (1, 128) or
    (128, 128) (floats, bools, other sizes) is a ValueError."""
    ok = (isinstance(block_shape, (tuple, list)) and all(_is_int(b) for b in block_shape)
          and tuple(int(b) for b in block_shape) in BLOCK_SHAPES)
    if not ok:
        raise ValueError(f"block_shape must be (1, 128) or (128, 128) (two ints), got "
                         f"{block_shape!r}")
    return int(block_shape[0])


def quantize_blocks(x: ArrayLike, block_shape: tuple[int, int] = (1, 128),
                    fp8_dtype: DTypeLike = jnp.float8_e4m3fn, *, power_of_2_scale: bool = True,
                    amax_epsilon: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Blockwise quantization of x laid out as ``[..., M, K]`` (K the contraction axis).

    Shapes: x [..., M, K] (float32/bfloat16/float16) -> (x_fp8 [..., M, K],
    scale_inv float32 [..., ceil(M/bm), ceil(K/bk)]) for block_shape (bm, bk) = (1, 128)
    (one scale per 128 values along K) or (128, 128) (one per tile of the last two axes);
    blocks cut short by the edges hold fewer values. ``x ~= x_fp8 * scale_inv`` broadcast
    over each block. Leading axes are independent. Not differentiated (a zero gradient).

    Example:

        q, s = jax_fp8.quantize_blocks(x)             # x [4096, 1024] -> s [4096, 8]
    """
    rows = _block_rows(block_shape)
    q, s = bq.block_quantize(_operand(x), block_rows=rows,
                             **_options(fp8_dtype, power_of_2_scale, amax_epsilon))
    return q, s


def quantize_blocks_transposed(x: ArrayLike, block_shape: tuple[int, int] = (1, 128),
                               fp8_dtype: DTypeLike = jnp.float8_e4m3fn, *,
                               power_of_2_scale: bool = True,
                               amax_epsilon: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """``quantize_blocks(swapaxes(x, -1, -2), ...)`` without a transposed copy of x.

    Shapes: x [..., M, K] -> (x_t_fp8 [..., K, M], scale_inv [..., ceil(K/bm), ceil(M/bk)]):
    for (1, 128) blocks the 128 values of a block run along M, quantized afresh from x
    (the column-wise copy the backward's GEMMs need); a (128, 128) tile is the same tile.
    """
    rows = _block_rows(block_shape)
    q_t, s_t = bq.block_quantize(_operand(x), block_rows=rows, rowwise=False, colwise=True,
                                 **_options(fp8_dtype, power_of_2_scale, amax_epsilon))
    return q_t, s_t


def quantize_blocks_both(x: ArrayLike, block_shape: tuple[int, int] = (1, 128),
                         fp8_dtype: DTypeLike = jnp.float8_e4m3fn, *,
                         power_of_2_scale: bool = True,
                         amax_epsilon: float = 0.0) -> tuple[jax.Array, ...]:
    """``quantize_blocks`` and ``quantize_blocks_transposed`` of x from one read of x (one
    kernel on CUDA): (x_fp8 [..., M, K], scale_inv, x_t_fp8 [..., K, M], scale_inv_t)."""
    rows = _block_rows(block_shape)
    return tuple(bq.block_quantize(_operand(x), block_rows=rows, rowwise=True, colwise=True,
                                   **_options(fp8_dtype, power_of_2_scale, amax_epsilon)))


def dequantize_blocks(x_fp8: ArrayLike, scale_inv: ArrayLike,
                      block_shape: Sequence[int] = (1, 128),
                      dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``x_fp8 * scale_inv`` broadcast over each block, in float32, cast to ``dtype``.

    Shapes: x_fp8 [..., M, K], scale_inv [..., ceil(M/bm), ceil(K/bk)] -> [..., M, K].
    The IEEE products (also for a subnormal scale_inv), except that products in the
    subnormal range read as zeros of their sign (XLA flushes them).
    """
    rows = _block_rows(block_shape)
    x_fp8, scale_inv = jnp.asarray(x_fp8), jnp.asarray(scale_inv, jnp.float32)
    want = x_fp8.shape[:-2] + (bq.scale_rows(x_fp8.shape[-2], rows), -(-x_fp8.shape[-1] // 128))
    if x_fp8.ndim < 2 or scale_inv.shape != want:
        raise ValueError(f"scale_inv must have shape {want} for x_fp8 {x_fp8.shape} and "
                         f"block_shape {tuple(block_shape)}, got {scale_inv.shape}")
    return gemm_lib.dequantize(x_fp8, scale_inv, rows).astype(dtype)
