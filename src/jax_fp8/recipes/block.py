"""Blockwise scaling (DeepSeek-V3's recipe, Transformer Engine's ``Float8BlockScaling``): one
scale per 1 x 128 block or 128 x 128 tile, in the Dense form of `jax_fp8.gemm.scaled_dot`:

  forward  out = x . w:    x quantized row-wise (blocks along K, role "x"), w column-wise
                           (the operand [N, K], role "w"), the block GEMM primitive
  dgrad    dx = g . w^T:   g row-wise (blocks along N, role "grad"), w row-wise ([K, N])
  wgrad    dw = x^T . g:   x column-wise ([K, M], blocks along M), g column-wise ([N, M])

Every GEMM is cuBLASLt's TN form: both operands contract over their minor axis. Each
tensor is quantized once, in both layouts from one read of it (one kernel on CUDA); a
1x128-blocked copy along the other axis is quantized afresh from the high precision
tensor (docs/semantics.md), a 128x128 tile is the same tile either way. The kernel writes
the scales in the layout the GEMM reads (scale_layout="gemm"), so on CUDA a forward and
backward is 3 quantization kernels and 3 GEMMs with no XLA op between them. The residuals
are the FP8 copies the backward needs (x column-wise, w row-wise, with their scales): 1 byte
per element instead of the high-precision input, and the backward reads neither x nor w
again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import block_gemm as gemm_lib, block_quantize as bq
from jax_fp8._primitives.exact import up_scaled
from jax_fp8.gemm import _grouped
from jax_fp8.gemm.scaled_dot import StatelessRecipe, Types, explicit_type, typed
from jax_fp8.recipe import Format

__all__ = ["Float8BlockScaling"]


@recipe_lib.register
@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(StatelessRecipe):
    """Blockwise scaling (DeepSeek-V3's recipe, TE's ``Float8BlockScaling``).

    One scale per ``1 x 128`` block (``*_block_scaling_dim=1``) or ``128 x 128`` tile
    (``=2``) of each GEMM operand laid out as ``[..., M, K]`` (K the contraction axis),
    from the block's own amax. At most one operand of a GEMM has 2-D blocks. No state
    is kept.

    Attributes:
      fp8_format: Format.E4M3 (the default, E4M3 everywhere) or Format.HYBRID.
      power_of_2_scale: round each scale down to a power of two (default True).
      amax_epsilon: lower bound applied to each block's amax.
      x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 or 2, for the
        input (activations), the kernel (weights) and the incoming gradient.
    """

    keeps_state: ClassVar[bool] = False
    auto_min_fp8_flops: ClassVar[float] = 2.0 ** 37

    fp8_format: Format = Format.E4M3
    power_of_2_scale: bool = True
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")
        recipe_lib._check_bool(self, "power_of_2_scale")
        recipe_lib._check_epsilon(self.amax_epsilon)
        dims = {}
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (1, 2):
                raise ValueError(f"{name} must be 1 or 2, got {value!r}")
            dims[name] = value
        # Each GEMM pairs two of the three operands (fwd: x, w; dgrad: grad, w; wgrad:
        # grad, x); a cuBLASLt block-scaled GEMM takes at most one 128 x 128 operand.
        for a, b in (("x", "w"), ("grad", "w"), ("grad", "x")):
            if dims[f"{a}_block_scaling_dim"] == dims[f"{b}_block_scaling_dim"] == 2:
                raise ValueError(f"{a}_block_scaling_dim and {b}_block_scaling_dim cannot "
                                 f"both be 2: at most one operand of a GEMM has 2-D blocks")

    def block_shape(self, role: str) -> tuple[int, int]:
        """The block shape of ``role`` ("x", "w" or "grad"): (1, 128) or (128, 128)."""
        dim = getattr(self, f"{role}_block_scaling_dim")
        return (1, 128) if dim == 1 else (128, 128)

    def _quantize(self, a: jax.Array, role: str, fp8_dtype: DTypeLike, rowwise: bool,
                  colwise: bool) -> list[jax.Array]:
        return bq.block_quantize(a, block_rows=self.block_shape(role)[0], fp8_dtype=fp8_dtype,
                                 power_of_2_scale=self.power_of_2_scale,
                                 amax_epsilon=self.amax_epsilon, rowwise=rowwise,
                                 colwise=colwise, scale_layout="gemm")

    def matmul_forward(self, x: jax.Array, w: jax.Array, out_dtype: DTypeLike, keep: bool,
                       ) -> tuple[jax.Array, tuple[Any, ...] | None]:
        fwd = self.fp8_format.fwd_dtype
        xr, wr = self.block_shape("x")[0], self.block_shape("w")[0]
        if keep:
            qx, sx, qx_t, sx_t = self._quantize(x, "x", fwd, True, True)
            qw_kn, sw_kn, qw, sw = self._quantize(w, "w", fwd, True, True)
            residuals = (qx_t, sx_t, qw_kn, sw_kn, Types(explicit_type(x), explicit_type(w)))
        else:
            qx, sx = self._quantize(x, "x", fwd, True, False)
            qw, sw = self._quantize(w, "w", fwd, False, True)
            residuals = None
        return _gemm(qx, sx, qw, sw, xr, wr, out_dtype), residuals

    def matmul_backward(self, residuals: tuple[Any, ...], g: jax.Array, x_dtype: DTypeLike,
                        w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        qx_t, sx_t, qw_kn, sw_kn, types = residuals
        xr, wr, gr = (self.block_shape(r)[0] for r in ("x", "w", "grad"))
        qg, sg, qg_t, sg_t = self._quantize(g, "grad", self.fp8_format.bwd_dtype, True, True)
        dx = _gemm(qg, sg, qw_kn, sw_kn, gr, wr, x_dtype)       # [M, N] . [K, N]^T
        dw = _gemm(qx_t, sx_t, qg_t, sg_t, xr, gr, w_dtype)     # [K, M] . [N, M]^T
        # On a mesh with Explicit axes each gradient is typed as its primal.
        return typed(dx, types.x), typed(dw, types.w)

    # ----------------------------------------------- grouped GEMMs (fp8_ragged_dot)
    # The input's and the gradient's 1 x 128 blocks run along K (N) within a row, so never
    # cross a group; each expert's weight has its own tiles (the leading axis G); the
    # weight gradient's token-axis blocks are cut at group boundaries (_grouped).

    def _blocks(self) -> _grouped.Blocks:
        for role in ("x", "grad"):
            if self.block_shape(role) != (1, 128):
                raise ValueError(
                    f"fp8_ragged_dot: Float8BlockScaling with {role}_block_scaling_dim=2 "
                    f"would give the {'input' if role == 'x' else 'gradient'} 128 x 128 tiles "
                    f"spanning two experts' tokens; a grouped GEMM takes "
                    f"{role}_block_scaling_dim=1 (1 x 128 blocks, the default)")

        # (q, scale_inv): the primitive's results, a list (Blocks says a tuple)
        def quantize(a: jax.Array, role: str, fp8_dtype: DTypeLike) -> Any:
            return bq.block_quantize(a, block_rows=self.block_shape(role)[0],
                                     fp8_dtype=fp8_dtype,
                                     power_of_2_scale=self.power_of_2_scale,
                                     amax_epsilon=self.amax_epsilon)

        def elements(x32: jax.Array, amax: jax.Array, fp8_dtype: DTypeLike,
                     ) -> tuple[jax.Array, jax.Array]:
            scale = bq.scale_from_amax_f32(amax, recipe_lib.fp8_max(fp8_dtype),
                                           self.amax_epsilon, self.power_of_2_scale)
            inverse = bq.pow2_inverse(scale) if self.power_of_2_scale else \
                bq.scale_inverse(scale)
            return bq.cast_scaled(x32, scale, fp8_dtype), inverse

        def dequantize_elements(q: jax.Array, scale_inv: jax.Array) -> jax.Array:
            s, f = up_scaled(scale_inv)
            return (q.astype(jnp.float32) * s) * f

        return _grouped.Blocks(
            block=bq.BLOCK, quantize=quantize,
            dequantize=lambda q, s, role: gemm_lib.dequantize(q, s, self.block_shape(role)[0]),
            elements=elements, dequantize_elements=dequantize_elements)

    def ragged_forward(self, x: jax.Array, w: jax.Array, ends: jax.Array, out_dtype: DTypeLike,
                       keep: bool) -> tuple[jax.Array, Any]:
        return _grouped.blocked_forward(self._blocks(), self.fp8_format.fwd_dtype, x, w, ends,
                                        out_dtype, keep)

    def ragged_backward(self, residuals: Any, g: jax.Array, ends: jax.Array, x_dtype: DTypeLike,
                        w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        return _grouped.blocked_backward(self._blocks(), self.fp8_format.bwd_dtype, residuals,
                                         g, ends, x_dtype, w_dtype)


def _gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array, ra: int, rb: int,
          out_dtype: DTypeLike) -> jax.Array:
    return gemm_lib.block_gemm(a, sa, b, sb, a_block_rows=ra, b_block_rows=rb,
                               out_dtype=out_dtype, scale_layout="gemm")
