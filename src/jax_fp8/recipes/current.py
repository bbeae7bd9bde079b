"""Current scaling (Transformer Engine's ``Float8CurrentScaling``): one scale per tensor, from
its own amax (``jax_fp8.compute_amax``; under a multi-device jit one max over all devices).

Its GEMMs are the ones delayed scaling runs (``_gemms.gemm``: XLA's FP8 GEMM on CUDA, the
result scaled by scale_inv_a * scale_inv_b), in the Dense form of `jax_fp8.gemm.scaled_dot`:

  forward  out = x . w     x and w quantized with fwd_dtype
  dgrad    dx  = g . w^T   g quantized with bwd_dtype (E5M2 under HYBRID)
  wgrad    dw  = x^T . g

The residuals are the FP8 x and w, whose transposes are byte transposes (one scale for the
whole tensor).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import block_quantize as bq, layout
from jax_fp8.gemm import _gemms, _grouped
from jax_fp8.gemm.scaled_dot import StatelessRecipe
from jax_fp8.quantization import current
from jax_fp8.recipe import Format

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Float8CurrentScaling"]

_TN = (((1,), (1,)), ((), ()))  # [A, C] . [B, C] -> [A, B]


@recipe_lib.register
@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(StatelessRecipe):
    """Current (per-tensor, just-in-time) scaling: each tensor's scale from its own amax.

    ``scale = fp8_max / max(amax, amax_epsilon)`` computed right before the cast
    (``docs/semantics.md``, "Scale from an amax"). No state is kept.

    Attributes:
      fp8_format: Format.HYBRID (E5M2 gradients, the default) or Format.E4M3.
      power_of_2_scale: round each scale down to a power of two.
      amax_epsilon: lower bound applied to each amax before the division.
    """

    keeps_state: ClassVar[bool] = False
    auto_min_fp8_flops: ClassVar[float] = 2.0 ** 37

    fp8_format: Format = Format.HYBRID
    power_of_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")
        recipe_lib._check_bool(self, "power_of_2_scale")
        recipe_lib._check_epsilon(self.amax_epsilon)

    def _quantize(self, a: jax.Array, fp8_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        return current.quantize_current(a, fp8_dtype, power_of_2_scale=self.power_of_2_scale,
                                        amax_epsilon=self.amax_epsilon)

    def matmul_forward(self, x: jax.Array, w: jax.Array, out_dtype: DTypeLike, keep: bool,
                       ) -> tuple[jax.Array, tuple[Any, ...] | None]:
        fwd = self.fp8_format.fwd_dtype
        qx, sx = self._quantize(x, fwd)
        qw, sw = self._quantize(w, fwd)
        out = _gemms.gemm(qx, *_gemms.rhs_for_forward(qw, (((1,), (0,)), ((), ()))), sx, sw,
                          out_dtype, out_sharding=_product_sharding(qx, qw))
        return out, ((qx, sx, qw, sw) if keep else None)

    def matmul_backward(self, residuals: tuple[Any, ...], g: jax.Array, x_dtype: DTypeLike,
                        w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        qx, sx, qw, sw = residuals
        qg, sg = self._quantize(g, self.fp8_format.bwd_dtype)
        hi = lax.Precision.HIGHEST
        # Each gradient takes its primal's sharding (a mesh with Explicit axes needs it
        # named where the GEMM contracts over a sharded axis, as wgrad does under data
        # parallelism).
        dx = _gemms.gemm(qg, qw, _TN, sg, sw, x_dtype, precision=hi,       # [M, N] . [K, N]^T
                         out_sharding=_gemms.permuted_sharding(qx, (0, 1), like=(qg, qw)))
        dw = _gemms.gemm(layout.rotate_axes(qx, 1), layout.rotate_axes(qg, 1), _TN, sx, sg,
                         w_dtype, precision=hi,                             # [K, M] . [N, M]^T
                         out_sharding=_gemms.permuted_sharding(qw, (0, 1), like=(qx, qg)))
        return dx, dw

    # ----------------------------------------------- grouped GEMMs (fp8_ragged_dot)
    # One scale per group of rows (the input, the gradient) and per expert (the weight),
    # each from its own amax (jax_fp8.gemm._grouped.group_amax: NaN-propagating, exact).

    def _quantize_groups(self, a: jax.Array, ends: jax.Array, fp8_dtype: DTypeLike,
                         ) -> tuple[jax.Array, jax.Array]:
        """a [M, C] quantized with its rows' group's scale: (q, scale_inv [G])."""
        group = _grouped.row_groups(ends, a.shape[0])
        scale = self._scale(_grouped.group_amax(a, group, ends.shape[0]), fp8_dtype)
        q = bq.cast_scaled(bq.widen(a), _grouped.rows_of(scale, group)[:, None], fp8_dtype)
        return q, bq.scale_inverse(scale)

    def _scale(self, amax: jax.Array, fp8_dtype: DTypeLike) -> jax.Array:
        return bq.scale_from_amax_f32(amax, recipe_lib.fp8_max(fp8_dtype), self.amax_epsilon,
                                      self.power_of_2_scale)

    def ragged_forward(self, x: jax.Array, w: jax.Array, ends: jax.Array, out_dtype: DTypeLike,
                       keep: bool) -> tuple[jax.Array, tuple[Any, ...] | None]:
        x, w = lax.stop_gradient(x), lax.stop_gradient(w)
        fwd = self.fp8_format.fwd_dtype
        qx, sx = self._quantize_groups(x, ends, fwd)
        scale_w = self._scale(_grouped.expert_amax(w), fwd)
        qw = bq.cast_scaled(bq.widen(w), scale_w[:, None, None], fwd)          # [G, K, N]
        sw = bq.scale_inverse(scale_w)
        out = _grouped.grouped(qx, jnp.swapaxes(qw, 1, 2), ends, sx, sw, out_dtype)
        return out, ((qx, sx, qw, sw) if keep else None)

    def ragged_backward(self, residuals: Any, g: jax.Array, ends: jax.Array, x_dtype: DTypeLike,
                        w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        qx, sx, qw, sw = residuals
        qg, sg = self._quantize_groups(g, ends, self.fp8_format.bwd_dtype)
        dx = _grouped.grouped(qg, qw, ends, sg, sw, x_dtype)           # [M, N] . [G, K, N]
        dw = _grouped.scaled_wgrad(qx, qg, ends, sx, sg, w_dtype)      # [G, K, N]
        return dx, dw


def _product_sharding(x: jax.Array, w: jax.Array) -> jax.sharding.NamedSharding | None:
    """On a mesh with Explicit axes: x [M, K] . w [K, N] sharded as x's rows and w's
    columns (a sharded K is summed over); None elsewhere."""
    rows = _gemms.permuted_sharding(x, (0, 1), like=(w,))
    cols = _gemms.permuted_sharding(w, (0, 1), like=(x,))
    if rows is None or cols is None:
        return None
    m, n = rows.spec[0] if rows.spec else None, cols.spec[1] if len(cols.spec) > 1 else None
    names: Callable[[Any], set[Any]] = lambda a: set(a if isinstance(a, tuple) else (a,)) - {None}  # noqa: E731
    if names(m) & names(n):
        n = None   # one mesh axis cannot shard both
    # PartitionSpec's constructor is unannotated in JAX.
    return rows.update(spec=jax.sharding.PartitionSpec(m, n))  # type: ignore[no-untyped-call]
