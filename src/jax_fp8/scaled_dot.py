"""FP8 dot_general for the current and blockwise recipes: operands quantized from their own amaxes,
forward and backward GEMMs in FP8 under one custom VJP.

``scaled_dot_general(lhs, rhs, dimension_numbers, recipe)`` brings the operands into the
Dense form x [M, K] . w [K, N] (lhs's free axes flattened into M, the contracting axes
into K; transposes where the axes are not in that order, reshapes otherwise), then:

Float8BlockScaling (DeepSeek-V3 / TE's recipe; E4M3, or E5M2 gradients under HYBRID)
  forward  out = x . w:    x quantized row-wise (blocks along K, role "x"), w column-wise
                           (the operand [N, K], role "w"), the block GEMM primitive
  dgrad    dx = g . w^T:   g row-wise (blocks along N, role "grad"), w row-wise ([K, N])
  wgrad    dw = x^T . g:   x column-wise ([K, M], blocks along M), g column-wise ([N, M])
  Every GEMM is cuBLASLt's TN form: both operands contract over their minor axis. Each
  tensor is quantized once, in both layouts from one read of it (one kernel on CUDA); a
  1x128-blocked copy along the other axis is quantized afresh from the high precision
  tensor (docs/semantics.md), a 128x128 tile is the same tile either way. The kernel writes the
  scales in the layout the GEMM reads (scale_layout="gemm"), so on CUDA a forward and
  backward is 3 quantization kernels and 3 GEMMs with no XLA op between them. The
  residuals are the FP8 copies the backward needs (x column-wise, w row-wise, with their
  scales): 1 byte per element instead of the high-precision input, and the backward reads
  neither x nor w again.
Float8CurrentScaling (one scale per tensor, from ``jax_fp8.compute_amax``)
  the three GEMMs as jax_fp8's delayed-scaling path runs them (``_gemms.gemm``: XLA's
  FP8 GEMM on CUDA, the result scaled by scale_inv_a * scale_inv_b); the residuals are
  the FP8 x and w, whose transposes are byte transposes (one scale for the whole tensor).
  Under a multi-device jit each amax is one max over all devices.

The quantization itself is not differentiated (its scales are constants of the step).
Gradients come back in lhs's and rhs's dtypes. Batch dimensions: ``jax.vmap`` of the
product without them, one GEMM per batch element.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fp8 import _ad, _gemms, current, recipe as recipe_lib
from jax_fp8._primitives import axis_types, block_gemm as gemm_lib, block_quantize as bq, layout

__all__ = ["scaled_dot_general"]

_TN = (((1,), (1,)), ((), ()))  # [A, C] . [B, C] -> [A, B]
_OP = "fp8_dot_general (current or block scaling)"


def scaled_dot_general(lhs, rhs, dimension_numbers, recipe, preferred_element_type=None):
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with FP8 GEMMs per ``recipe``.

    Shapes: those of ``lax.dot_general``: lhs [B..., L..., C...] and rhs [B..., C..., R...]
    (the batch axes B and contracting axes C anywhere, as ``dimension_numbers = ((lhs_contracting,
    rhs_contracting), (lhs_batch, rhs_batch))`` says) -> out [B..., L..., R...] in
    ``preferred_element_type`` (default: the operands' result type).

    Batch axes: the result is, bit for bit, ``jax.vmap`` of the call without them over the
    batch axes (flattened into one), so each batch element is a GEMM of its own: under
    current scaling each element's lhs and rhs slice has its own scale (its own amax), and
    block scaling's blocks never span two elements.

    Differentiable once, under any remat policy; differentiating the gradient again
    raises ``NotImplementedError`` at trace time (as `jax_fp8.fp8_dot_general`).

    Args:
      recipe: ``jax_fp8.Float8CurrentScaling`` or ``jax_fp8.Float8BlockScaling``.

    Example (a Dense layer):

        y = scaled_dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                               jax_fp8.Float8BlockScaling())   # x [B, T, D], kernel [D, H]
    """
    if not isinstance(recipe, (recipe_lib.Float8CurrentScaling, recipe_lib.Float8BlockScaling)):
        raise TypeError(f"recipe must be a jax_fp8.Float8CurrentScaling or Float8BlockScaling, "
                        f"got {type(recipe).__name__}")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if np.dtype(a.dtype) not in bq.INPUT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {a.dtype}")
    (lc, rc), (lb, rb) = dimension_numbers
    lc, lb = (tuple(int(a) % lhs.ndim for a in axes) for axes in (lc, lb))
    rc, rb = (tuple(int(a) % rhs.ndim for a in axes) for axes in (rc, rb))
    if (len(lc) != len(rc) or len(set(lc)) != len(lc) or len(set(rc)) != len(rc)
            or any(lhs.shape[a] != rhs.shape[b] for a, b in zip(lc, rc))):
        raise ValueError(f"scaled_dot_general: contracting dimensions {lc} of lhs "
                         f"{lhs.shape} and {rc} of rhs {rhs.shape} do not match")
    if (len(lb) != len(rb) or len(set(lb)) != len(lb) or len(set(rb)) != len(rb)
            or set(lb) & set(lc) or set(rb) & set(rc)
            or any(lhs.shape[a] != rhs.shape[b] for a, b in zip(lb, rb))):
        raise ValueError(f"scaled_dot_general: batch dimensions {lb} of lhs {lhs.shape} and "
                         f"{rb} of rhs {rhs.shape} do not match (or overlap the contracting "
                         f"ones)")
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else jnp.result_type(lhs, rhs))
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"preferred_element_type must be floating, got {out_dtype}")
    if not lb:
        return _unbatched(lhs, rhs, lc, rc, recipe, out_dtype)
    # Batch axes first and flattened into one, the rest in their order; vmap over it.
    lr = [a for a in range(lhs.ndim) if a not in lb]
    rr = [a for a in range(rhs.ndim) if a not in rb]
    batch_shape = tuple(lhs.shape[a] for a in lb)
    lhs_b = _permute(lhs, list(lb) + lr).reshape((-1,) + tuple(lhs.shape[a] for a in lr))
    rhs_b = _permute(rhs, list(rb) + rr).reshape((-1,) + tuple(rhs.shape[a] for a in rr))
    inner_lc = tuple(lr.index(a) for a in lc)
    inner_rc = tuple(rr.index(a) for a in rc)
    out = jax.vmap(lambda a, b: _unbatched(a, b, inner_lc, inner_rc, recipe, out_dtype))(
        lhs_b, rhs_b)
    return out.reshape(batch_shape + out.shape[1:])


def _unbatched(lhs, rhs, lc, rc, recipe, out_dtype):
    """scaled_dot_general without batch axes: the operands as x [M, K] and w [K, N]."""
    lf = [a for a in range(lhs.ndim) if a not in lc]
    rf = [a for a in range(rhs.ndim) if a not in rc]
    m = math.prod(lhs.shape[a] for a in lf)
    k = math.prod(lhs.shape[a] for a in lc)
    n = math.prod(rhs.shape[a] for a in rf)
    x = _permute(lhs, lf + list(lc)).reshape(m, k)
    w = _permute(rhs, list(rc) + rf).reshape(k, n)
    x, w = axis_types.vary_like([x, w])
    out = _fp8_matmul(x, w, recipe, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    return out.reshape(tuple(lhs.shape[a] for a in lf) + tuple(rhs.shape[a] for a in rf))


def _permute(a, perm):
    return a if list(perm) == list(range(a.ndim)) else lax.transpose(a, tuple(perm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_matmul(x, w, recipe, out_dtype, x_dtype, w_dtype):
    """x [M, K] . w [K, N] -> [M, N] in out_dtype."""
    del x_dtype, w_dtype
    return _forward(x, w, recipe, out_dtype, keep=False)[0]


def _fwd(x, w, recipe, out_dtype, x_dtype, w_dtype):
    del x_dtype, w_dtype
    x, w = _ad.first_order_only((x, w), _OP)
    out, residuals = _forward(x, w, recipe, out_dtype, keep=True)
    # Stored as integers: remat policies that save residuals leave their bytes alone.
    return out, _ad.hide(residuals)


def _bwd(recipe, out_dtype, x_dtype, w_dtype, residuals, g):
    del out_dtype
    residuals, g = _ad.first_order_only((_ad.reveal(residuals), g), _OP)
    if isinstance(recipe, recipe_lib.Float8BlockScaling):
        return _block_backward(recipe, residuals, g, x_dtype, w_dtype)
    return _current_backward(recipe, residuals, g, x_dtype, w_dtype)


_fp8_matmul.defvjp(_fwd, _bwd)


def _forward(x, w, recipe, out_dtype, keep):
    if isinstance(recipe, recipe_lib.Float8BlockScaling):
        return _block_forward(x, w, recipe, out_dtype, keep)
    return _current_forward(x, w, recipe, out_dtype, keep)


# ------------------------------------------------------------------------------ blockwise

def _quantize(a, recipe, role, fp8_dtype, rowwise, colwise):
    return bq.block_quantize(a, block_rows=recipe.block_shape(role)[0], fp8_dtype=fp8_dtype,
                             power_of_2_scale=recipe.power_of_2_scale,
                             amax_epsilon=recipe.amax_epsilon, rowwise=rowwise, colwise=colwise,
                             scale_layout="gemm")


def _gemm(a, sa, b, sb, ra, rb, out_dtype):
    return gemm_lib.block_gemm(a, sa, b, sb, a_block_rows=ra, b_block_rows=rb,
                               out_dtype=out_dtype, scale_layout="gemm")


def _block_forward(x, w, recipe, out_dtype, keep):
    fwd = recipe.fp8_format.fwd_dtype
    xr, wr = recipe.block_shape("x")[0], recipe.block_shape("w")[0]
    if keep:
        qx, sx, qx_t, sx_t = _quantize(x, recipe, "x", fwd, True, True)
        qw_kn, sw_kn, qw, sw = _quantize(w, recipe, "w", fwd, True, True)
        residuals = (qx_t, sx_t, qw_kn, sw_kn, _Types(_explicit_type(x), _explicit_type(w)))
    else:
        qx, sx = _quantize(x, recipe, "x", fwd, True, False)
        qw, sw = _quantize(w, recipe, "w", fwd, False, True)
        residuals = None
    return _gemm(qx, sx, qw, sw, xr, wr, out_dtype), residuals


def _block_backward(recipe, residuals, g, x_dtype, w_dtype):
    qx_t, sx_t, qw_kn, sw_kn, types = residuals
    xr, wr, gr = (recipe.block_shape(r)[0] for r in ("x", "w", "grad"))
    qg, sg, qg_t, sg_t = _quantize(g, recipe, "grad", recipe.fp8_format.bwd_dtype, True, True)
    dx = _gemm(qg, sg, qw_kn, sw_kn, gr, wr, x_dtype)       # [M, N] . [K, N]^T
    dw = _gemm(qx_t, sx_t, qg_t, sg_t, xr, gr, w_dtype)     # [K, M] . [N, M]^T
    # On a mesh with Explicit axes each gradient is typed as its primal: a reshard
    # (e.g. a slice of a weight gradient the GEMM summed over the sharded batch).
    return _typed(dx, types.x), _typed(dw, types.w)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Types:
    """The primals' shardings on a mesh with Explicit axes (None elsewhere), kept with the
    residuals as static data."""
    x: object
    w: object


def _explicit_type(a):
    return jax.typeof(a).sharding if axis_types.on_explicit_mesh(a) else None


def _typed(grad, sharding):
    return grad if sharding is None else jax.sharding.reshard(grad, sharding)


# -------------------------------------------------------------------------------- current

def _current(a, recipe, fp8_dtype):
    return current.quantize_current(a, fp8_dtype, power_of_2_scale=recipe.power_of_2_scale,
                                      amax_epsilon=recipe.amax_epsilon)


def _current_forward(x, w, recipe, out_dtype, keep):
    fwd = recipe.fp8_format.fwd_dtype
    qx, sx = _current(x, recipe, fwd)
    qw, sw = _current(w, recipe, fwd)
    out = _gemms.gemm(qx, *_gemms.rhs_for_forward(qw, (((1,), (0,)), ((), ()))), sx, sw,
                      out_dtype, out_sharding=_product_sharding(qx, qw))
    return out, ((qx, sx, qw, sw) if keep else None)


def _current_backward(recipe, residuals, g, x_dtype, w_dtype):
    qx, sx, qw, sw = residuals
    qg, sg = _current(g, recipe, recipe.fp8_format.bwd_dtype)
    hi = lax.Precision.HIGHEST
    # Each gradient takes its primal's sharding (a mesh with Explicit axes needs it named
    # where the GEMM contracts over a sharded axis, as wgrad does under data parallelism).
    dx = _gemms.gemm(qg, qw, _TN, sg, sw, x_dtype, precision=hi,          # [M, N] . [K, N]^T
                     out_sharding=_gemms.permuted_sharding(qx, (0, 1), like=(qg, qw)))
    dw = _gemms.gemm(layout.rotate_axes(qx, 1), layout.rotate_axes(qg, 1), _TN, sx, sg,
                     w_dtype, precision=hi,                                # [K, M] . [N, M]^T
                     out_sharding=_gemms.permuted_sharding(qw, (0, 1), like=(qx, qg)))
    return dx, dw


def _product_sharding(x, w):
    """On a mesh with Explicit axes: x [M, K] . w [K, N] sharded as x's rows and w's
    columns (a sharded K is summed over); None elsewhere."""
    rows = _gemms.permuted_sharding(x, (0, 1), like=(w,))
    cols = _gemms.permuted_sharding(w, (0, 1), like=(x,))
    if rows is None or cols is None:
        return None
    m, n = rows.spec[0] if rows.spec else None, cols.spec[1] if len(cols.spec) > 1 else None
    names = lambda a: set(a if isinstance(a, tuple) else (a,)) - {None}  # noqa: E731
    if names(m) & names(n):
        n = None   # one mesh axis cannot shard both
    return rows.update(spec=jax.sharding.PartitionSpec(m, n))
