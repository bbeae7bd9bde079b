"""`fp8_dot_general`: ``lax.dot_general`` with FP8 operands, delayed scaling, a custom VJP.

Forward: the input (lhs) and kernel (rhs) are quantized with their states' current scales
(E4M3), the FP8 GEMM runs, and its result is dequantized. Backward: the incoming gradient
is quantized (E5M2 under HYBRID) and both gradients are FP8 GEMMs (``_gemms.py``). The
amaxes observed on the way leave as the meta's cotangent (``meta.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import _ad, _gemms, meta as meta_lib, recipe as recipe_lib
from jax_fp8._primitives import amax as amax_lib, layout
from jax_fp8.current import scale_inverse
from jax_fp8.meta import Fp8Meta
from jax_fp8.quantization import compute_amax, quantize
from jax_fp8.scaled_dot import scaled_dot_general
from jax_fp8.state import ScalingState

__all__ = ["fp8_dot_general", "gemm_flops"]


def _dequantization_factor(state: ScalingState) -> jax.Array:
    """``1 / state.scale``, derived at use: the stored ``scale_inv`` is not read, so a
    state whose two floats were changed apart (an average of states, e.g. an EMA of the
    variables) still dequantizes what it quantized. The same bits as the update's
    ``scale_inv`` (docs/semantics.md)."""
    return scale_inverse(state.scale)


def _fwd(lhs, rhs, meta, dimension_numbers, out_dtype):
    q_lhs, q_rhs = quantize(lhs, meta.input), quantize(rhs, meta.kernel)
    out = _gemms.gemm(q_lhs, *_gemms.rhs_for_forward(q_rhs, dimension_numbers),
                      _dequantization_factor(meta.input), _dequantization_factor(meta.kernel),
                      out_dtype)
    # The meta is returned unchanged: its only job is to carry the cotangent chain.
    # lhs[:0], rhs[:0]: empty arrays that carry the primal inputs' manual-axis types
    # (shard_map's vma) to the backward rule.
    res = (_gemms.lhs_for_kernel_grad(q_lhs, dimension_numbers), q_rhs, meta,
           compute_amax(lhs), compute_amax(rhs), jnp.ravel(lhs)[:0], jnp.ravel(rhs)[:0])
    return (out, meta), res


def _to_primal_vma(ct, primal_like, reduce):
    """Inside shard_map (check_vma): a cotangent varying over manual axes its primal
    does not vary over is reduced over them: summed for a gradient, as the transpose of
    JAX's implicit broadcast is, and max-ed for an amax."""
    extra = tuple(sorted(amax_lib.varying_axes(ct) - amax_lib.varying_axes(primal_like)))
    return reduce(ct, extra) if extra else ct


def _pmax_ignoring_nan(x, axes):
    # As reduce_amaxes: a NaN amax on one device is ignored, not spread to all.
    return lax.pmax(jnp.where(jnp.isnan(x), -jnp.inf, x), axes)


def _bwd(dimension_numbers, out_dtype, lhs_dtype, rhs_dtype, res, cts):
    g, ct_meta = cts
    if isinstance(g, SymbolicZero):  # only the threaded meta is used downstream
        g = jnp.zeros(g.aval.shape, g.aval.dtype)
    res, g = _ad.first_order_only((_ad.reveal(res), g), "fp8_dot_general")
    lhs_res, q_rhs, meta, amax_lhs, amax_rhs, lhs_like, rhs_like = res
    perm = _gemms.kernel_grad_layout(dimension_numbers, lhs_res.ndim)
    n_fl = _gemms.lhs_free_axes(g, q_rhs, dimension_numbers[0][1])
    g_t = None
    if perm is not None and 0 < n_fl < g.ndim and layout.quantize_rotate_applies(
            g, meta.grad.fp8_dtype):
        # One pass over g for its FP8 copy, that copy transposed for the kernel gradient,
        # and its amax (on CUDA a kernel of jax_fp8's; XLA would take three).
        q_g, g_t, amax_g = layout.quantize_rotate(g, n_fl, meta.grad.scale,
                                                  meta.grad.fp8_dtype)
    else:
        amax_g = compute_amax(g)
        q_g = quantize(g, meta.grad)
    lhs_aval = lhs_res if perm is None else _gemms.untransposed_aval(lhs_res, perm)
    grad_lhs = _gemms.input_grad(q_g, lhs_aval, q_rhs, dimension_numbers, lhs_dtype,
                                 (_dequantization_factor(meta.grad),
                                  _dequantization_factor(meta.kernel)))
    if perm is None:
        grad_rhs = _gemms.rhs_grad(q_g, lhs_res, q_rhs, dimension_numbers, rhs_dtype,
                                   (_dequantization_factor(meta.grad),
                                    _dequantization_factor(meta.input)))
    else:
        grad_rhs = _gemms.kernel_grad(q_g, lhs_res, q_rhs, dimension_numbers, rhs_dtype,
                                      (_dequantization_factor(meta.input),
                                       _dequantization_factor(meta.grad)), g_t=g_t)
    ct_meta_in = Fp8Meta(input=meta_lib.amax_cotangent(ct_meta.input, amax_lhs, meta.input),
                         kernel=meta_lib.amax_cotangent(ct_meta.kernel, amax_rhs, meta.kernel),
                         grad=meta_lib.amax_cotangent(ct_meta.grad, amax_g, meta.grad))
    grad_lhs = _to_primal_vma(grad_lhs, lhs_like, lax.psum)
    grad_rhs = _to_primal_vma(grad_rhs, rhs_like, lax.psum)
    ct_meta_in = jax.tree.map(
        lambda ct, primal: _to_primal_vma(ct, primal, _pmax_ignoring_nan), ct_meta_in, meta)
    return grad_lhs, grad_rhs, ct_meta_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_dot(lhs, rhs, meta, dimension_numbers, out_dtype, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    return _fwd(lhs, rhs, meta, dimension_numbers, out_dtype)[0]


def _fwd_rule(lhs, rhs, meta, dimension_numbers, out_dtype, lhs_dtype, rhs_dtype):
    # symbolic_zeros=True: the primals arrive wrapped.
    del lhs_dtype, rhs_dtype
    lhs, rhs, meta = jax.tree.map(lambda p: p.value, (lhs, rhs, meta),
                                  is_leaf=lambda p: isinstance(p, jax.custom_derivatives.
                                                               CustomVJPPrimal))
    lhs, rhs, meta = _ad.first_order_only((lhs, rhs, meta), "fp8_dot_general")
    out, res = _fwd(lhs, rhs, meta, dimension_numbers, out_dtype)
    # Stored as integers: remat policies that save residuals leave their bytes alone.
    return out, _ad.hide(res)


# symbolic_zeros: the backward rule sees which cotangents are known zeros (an unused
# threaded meta), see meta.amax_cotangent.
_fp8_dot.defvjp(_fwd_rule, _bwd, symbolic_zeros=True)


def check_meta(meta, name: str = "meta"):
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"{name} must be a jax_fp8.Fp8Meta, got {type(meta).__name__}")
    if meta.recipe is not None:
        recipe_lib.check_recipe(meta.recipe, f"{name}.recipe")
        if isinstance(meta.recipe, recipe_lib.DelayedScaling):
            raise TypeError(f"{name}.recipe: a delayed-scaling meta holds states, not a "
                            f"recipe; make it with Fp8Meta.create(DelayedScaling(...))")
        for field in ("input", "kernel", "grad"):
            if getattr(meta, field) is not None:
                raise TypeError(f"{name}.{field} must be None for {type(meta.recipe).__name__} "
                                f"(a stateless recipe)")
        return
    for field in ("input", "kernel", "grad"):
        st = getattr(meta, field)
        if not isinstance(st, ScalingState):
            raise TypeError(f"{name}.{field} must be a ScalingState, got {type(st).__name__}")
        for leaf_name in ("amax_history", "scale", "scale_inv"):
            leaf = getattr(st, leaf_name)
            if not hasattr(leaf, "shape") or getattr(leaf, "dtype", None) != jnp.float32:
                raise TypeError(f"{name}.{field}.{leaf_name} must be a float32 array, got "
                                f"{getattr(leaf, 'dtype', type(leaf).__name__)}")
        if tuple(st.scale.shape) != () or tuple(st.scale_inv.shape) != () \
                or st.amax_history.ndim != 1:
            raise ValueError(f"{name}.{field} must be the state of one tensor (scale shape "
                             f"(), history [L]), got scale shape {tuple(st.scale.shape)}; for "
                             f"stacked layers slice the meta per layer (lax.scan xs / nn.scan)")


def canonical_dimension_numbers(dimension_numbers, lhs_ndim, rhs_ndim):
    """((lc, rc), (lb, rb)) as tuples of ints, checked against the operands' ranks."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        dn = ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
              (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))
    except (TypeError, ValueError):
        raise TypeError(f"dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                        f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    (lc, rc), (lb, rb) = dn
    for side, axes, ndim in (("lhs", lc + lb, lhs_ndim), ("rhs", rc + rb, rhs_ndim)):
        if any(not 0 <= a < ndim for a in axes) or len(set(axes)) != len(axes):
            raise ValueError(f"dimension_numbers {dimension_numbers!r}: {side} axes must be "
                             f"distinct and in [0, {ndim})")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"dimension_numbers {dimension_numbers!r}: lhs and rhs need as many "
                         f"contracting and batch axes")
    return dn


# The name scope of a GEMM that min_fp8_flops keeps in its operands' dtype.
KEPT_SCOPE = "below_min_fp8_flops"


def gemm_flops(lhs_shape, rhs_shape, dimension_numbers) -> int:
    """2 * batch * M * N * K: the FLOPs of ``lax.dot_general`` on these shapes."""
    batch, m, n, k = _gemms.gemm_sizes(lhs_shape, rhs_shape, dimension_numbers)
    return 2 * batch * m * n * k


def check_min_fp8_flops(value, name: str = "min_fp8_flops") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of FLOPs (int or float), got {value!r}")
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def fp8_dot_general(lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: Any, meta: Fp8Meta,
                    precision: Any = None, preferred_element_type: DTypeLike | None = None, *,
                    min_fp8_flops: float = 0, **unused_kwargs: Any,
                    ) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``lax.dot_general``; returns ``(out, meta)``.

    Shapes are those of ``lax.dot_general(lhs, rhs, dimension_numbers)``; lhs is the
    input (activations), rhs the kernel (weights). A meta of a current or blockwise recipe
    (``Fp8Meta.create(Float8BlockScaling())``) runs ``jax_fp8.scaled_dot.scaled_dot_general``
    and is returned as is. Delayed scaling (the rest of this docstring): both are quantized with
    ``meta.input`` / ``meta.kernel`` (their current scales), the FP8 arrays go straight
    into ``lax.dot_general`` and the result is multiplied by both ``1 / scale``. Backward:
    the incoming gradient is quantized with ``meta.grad`` and both the input and the
    kernel gradient are FP8 GEMMs.

    No state is updated here. The observed amaxes come out as the gradient w.r.t. ``meta``
    (see ``jax_fp8.meta``); the returned ``meta`` holds the same values and must be what a
    later use of the same state gets, so the amaxes of all uses combine by max (a second
    use of one meta value is an error). ``precision`` is ignored (FP8 GEMMs have one
    precision); other keyword arguments (e.g. Flax's ``out_sharding``) are accepted and
    ignored.

    Differentiation: reverse mode (``jax.grad``, ``jax.vjp``), under any remat policy
    (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``) with the same bits as without;
    differentiating the gradient again (``jax.hessian``, ``jax.grad`` of a gradient, a
    Hessian-vector product) raises ``NotImplementedError`` at trace time.

    ``min_fp8_flops``: a GEMM too small to gain from FP8 (fewer FLOPs than this, counted
    as ``2 * batch * M * N * K`` of the forward product, see `gemm_flops`) runs as
    ``lax.dot_general`` in the operands' dtype instead, with ``precision`` as given, and
    ``meta`` is returned untouched (a delayed-scaling state then sees no amax). 0, the
    default, keeps every GEMM in FP8. Where FP8 starts to pay is a property of the GPU:
    see docs/benchmarks.md ("One Dense layer").

    Example:

        meta = jax_fp8.Fp8Meta.create()
        out, meta = jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta)

    Returns:
      (out, meta): ``out`` in ``preferred_element_type`` (default: the result type of
      lhs and rhs), and the meta to thread to the next use.
    """
    del unused_kwargs  # precision: used only by a GEMM kept out of FP8
    check_meta(meta)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got {x.dtype}")
    if preferred_element_type is not None and (
            not jnp.issubdtype(preferred_element_type, jnp.floating)
            or np.dtype(preferred_element_type).itemsize < 2):
        raise TypeError(f"preferred_element_type must be a floating dtype of at least 16 "
                        f"bits, got {preferred_element_type!r}")
    dn = canonical_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else jnp.result_type(lhs, rhs))
    if check_min_fp8_flops(min_fp8_flops) and \
            gemm_flops(lhs.shape, rhs.shape, dn) < min_fp8_flops:
        dtype = jnp.result_type(lhs, rhs)
        with jax.named_scope(KEPT_SCOPE):   # what jax_fp8.devtools.explain reads
            out = lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dn,
                                  precision=precision, preferred_element_type=out_dtype)
        return out, meta
    # float16 operands and results run as float32 inside, rounded to float16 once at the
    # end (the same bits: the FP8 GEMMs' results are float32 either way); a GEMM of FP8
    # values scaled up to fp8_max can exceed float16's range before its scaling.
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    if f16 in (np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype):
        wide_lhs, wide_rhs = (x.astype(f32) if np.dtype(x.dtype) == f16 else x
                              for x in (lhs, rhs))
        out, meta = fp8_dot_general(wide_lhs, wide_rhs, dn, meta,
                                    preferred_element_type=f32 if out_dtype == f16 else out_dtype)
        return out.astype(out_dtype), meta
    if meta.stateless:  # current / blockwise: scales from the operands themselves
        return scaled_dot_general(lhs, rhs, dn, meta.recipe, out_dtype), meta
    meta_lib.claim(meta, "fp8_dot_general", (lhs, rhs))
    return _fp8_dot(lhs, rhs, meta, dn, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
