"""The three FP8 GEMMs of one fp8_dot_general: the forward product and its two AD
transposes (the input and kernel gradients), written for FP8 operands.

JAX's own transpose rules of ``dot_general`` assume both operands share a dtype; here each
operand is FP8 with its own scale_inv, the result is dequantized by their product, and the
kernel gradient contracts over both operands' minor axes (the only layout cuBLASLt's FP8
GEMMs take on sm_90), using the byte-transpose kernels of ``_primitives/layout.py``.
Shardings of the results follow the primal operands' (Explicit meshes need them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import base, layout


def remaining(original: Iterable[int], *removed_lists: Iterable[int]) -> list[int]:
    removed: set[int] = set()
    for r in removed_lists:
        removed.update(r)
    return [i for i in original if i not in removed]


def _ranges_like(*xs: Sequence[Any]) -> Iterator[range]:
    start = 0
    for x in xs:
        yield range(start, start + len(x))
        start += len(x)


def input_grad(g: jax.Array, x: Any, y: jax.Array, dimension_numbers: lax.DotDimensionNumbers,
               out_dtype: DTypeLike, scale_invs: tuple[Any, Any],
               swap_ans: bool = False) -> jax.Array:
    """d(dot_general(x, y))/dx applied to g (JAX's own rule, written for FP8 operands).

    Like JAX's rule it asks for x's own sharding on the result, which a mesh with
    Explicit axes needs when the contraction runs over a sharded (batch) axis. x may be
    an array or just its abstract value (only its rank and sharding are read).
    """
    x_ndim = x.ndim
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = remaining(range(x_ndim), x_contract, x_batch)
    y_kept = remaining(range(y.ndim), y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    unsorted_axes = list(x_batch) + x_kept + x_contract_sorted_by_y
    out_axes = np.argsort(unsorted_axes)
    # HIGHEST: no fast (reduced-precision) FP8 accumulation for the gradient GEMMs, as
    # Flax and Transformer Engine do; the forward GEMM may use it (DEFAULT).
    out = gemm(g, y, dims, *scale_invs, out_dtype, precision=lax.Precision.HIGHEST,
               out_sharding=permuted_sharding(x, unsorted_axes, like=(g, y)))
    return lax.transpose(out, tuple(int(a) for a in out_axes))


def _sharding_of(x: Any) -> Any:
    return getattr(x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x), "sharding",
                   None)


def permuted_sharding(x: Any, axes: Sequence[int],
                      like: Sequence[Any] = ()) -> jax.sharding.NamedSharding | None:
    """x's sharding (x an array or an abstract value) with its spec reordered to `axes`.

    Where x's type has no mesh but an operand in `like` is typed on one (a mesh with
    Explicit axes), x is replicated on that mesh; None when no operand has a mesh.
    """
    sharding = _sharding_of(x)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        for other in like:
            other_mesh = getattr(_sharding_of(other), "mesh", None)
            if other_mesh is not None and not other_mesh.empty:
                # PartitionSpec's constructor is unannotated in JAX.
                return jax.sharding.NamedSharding(
                    other_mesh, jax.sharding.PartitionSpec())  # type: ignore[no-untyped-call]
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return cast(jax.sharding.NamedSharding, sharding.update(
        spec=jax.sharding.PartitionSpec(*(spec[a] for a in axes))))  # type: ignore[no-untyped-call]


def untransposed_aval(x_t: jax.Array, perm: Sequence[int]) -> Any:
    """The abstract value of x, given x_t = transpose(x, perm): shape and sharding."""
    aval = jax.typeof(x_t)
    inv = [int(i) for i in np.argsort(perm)]
    shape = tuple(aval.shape[i] for i in inv)
    sharding = permuted_sharding(x_t, inv)
    return aval.update(shape=shape, sharding=sharding) if sharding is not None else \
        aval.update(shape=shape)


def rhs_grad(g: jax.Array, x: jax.Array, y: Any, dimension_numbers: lax.DotDimensionNumbers,
             out_dtype: DTypeLike, scale_invs: tuple[Any, Any]) -> jax.Array:
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return input_grad(g, y, x, swapped, out_dtype, scale_invs, swap_ans=True)


# Result dtypes the GEMM writes directly: XLA folds the dequantization factor into the
# cuBLASLt FP8 GEMM as its output scale for these. Others (float16, whose range a
# GEMM of FP8 values scaled up to fp8_max overflows) are produced in float32 first.
_DIRECT_OUT = (np.dtype(jnp.bfloat16), np.dtype(np.float32))


def gemm_sizes(a_shape: Sequence[int], b_shape: Sequence[int],
               dimension_numbers: lax.DotDimensionNumbers) -> tuple[int, ...]:
    """(batch, M, N, K) of ``lax.dot_general(a, b, dimension_numbers)``: the products of
    the batch axes, of a's and b's free axes and of the contracting axes."""
    (a_c, b_c), (a_b, b_b) = dimension_numbers
    a_free = remaining(range(len(a_shape)), a_c, a_b)
    b_free = remaining(range(len(b_shape)), b_c, b_b)
    return tuple(math.prod(shape[i] for i in axes)
                 for shape, axes in ((a_shape, a_b), (a_shape, a_free), (b_shape, b_free),
                                     (a_shape, a_c)))


# The name scope of a product of FP8-quantized operands widened by `keep_fp8`, and why
# (jax_fp8.devtools.explain reads both: the scope marks the GEMM, the reason is its row's).
WIDENED_SCOPE = "fp8_operands_widened"
WIDENED_REASON = ("FP8-quantized operands, widened and multiplied in their result's dtype: a "
                  "size of the GEMM (M, N or K) is not a multiple of 16, or both operands "
                  "are E5M2, which FP8 GEMMs do not take")


def widens(a_dtype: DTypeLike, b_dtype: DTypeLike, a_shape: Sequence[int],
           b_shape: Sequence[int], dimension_numbers: lax.DotDimensionNumbers) -> bool:
    """Whether `keep_fp8` widens these FP8 operands (`WIDENED_REASON`): the one decision."""
    _, *sizes = gemm_sizes(a_shape, b_shape, dimension_numbers)
    e5m2 = np.dtype(jnp.float8_e5m2)
    return (np.dtype(a_dtype) == np.dtype(b_dtype) == e5m2) or any(d % 16 for d in sizes)


def keep_fp8(q_a: jax.Array, q_b: jax.Array, dimension_numbers: lax.DotDimensionNumbers,
             out_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """q_a, q_b as the GEMM must see them. Where XLA:GPU runs no FP8 GEMM (a size not a
    multiple of 16, or two E5M2 operands) it widens the FP8 operands itself, and two
    things go wrong there: its default excess precision (``xla_allow_excess_precision``)
    folds the widening into the quantization, dropping the FP8 rounding (``f32 -> f8 ->
    bf16`` becomes ``f32 -> bf16``: a result closer to the unquantized product, and
    different from the same call run eagerly); and for a float32 result it widens to
    float16 and overflows (a 2x8x4 product of 448s gives inf). Here an optimization barrier
    keeps the FP8 values and they are widened explicitly, exactly, to bfloat16 for a
    bfloat16 result and to float32 otherwise; sizes the FP8 GEMM takes (every multiple of
    16) go straight in."""
    if widens(q_a.dtype, q_b.dtype, q_a.shape, q_b.shape, dimension_numbers):
        wide = jnp.bfloat16 if np.dtype(out_dtype) == np.dtype(jnp.bfloat16) else jnp.float32
        # lax.optimization_barrier is unannotated in JAX.
        q_a, q_b = lax.optimization_barrier((q_a, q_b))  # type: ignore[no-untyped-call]
        return q_a.astype(wide), q_b.astype(wide)
    return q_a, q_b


def gemm(q_a: jax.Array, q_b: jax.Array, dimension_numbers: lax.DotDimensionNumbers,
         scale_inv_a: ArrayLike, scale_inv_b: ArrayLike, out_dtype: DTypeLike,
         precision: Any = None, out_sharding: Any = None) -> jax.Array:
    """``dot_general(q_a * scale_inv_a, q_b * scale_inv_b)`` in ``out_dtype`` for FP8 q_a, q_b.

    The FP8 operands go straight into ``lax.dot_general`` (on GPUs with FP8 tensor cores
    XLA rewrites it into a cuBLASLt FP8 GEMM) and the result is multiplied by
    ``scale_inv_a * scale_inv_b``. For bfloat16 and float32 results that product is taken
    in ``out_dtype`` right on the GEMM's output, so XLA folds it into the GEMM as its scale
    (one rounding, in float32, inside the GEMM). The factor itself is then rounded to
    ``out_dtype`` first: for bfloat16 a relative error of at most 2**-8 (half an ulp of
    an 8-bit significand; e.g. 1.0038 becomes 1.0), so the dequantized result carries at
    most that error on top of its own rounding to bfloat16. Other result dtypes (float16)
    are computed in float32 and rounded once at the end. Where the product of the
    scale_invs is below float32's normal range it is applied as two factors
    (`dequantization_factors`), so a result in the normal range is not flushed.
    """
    out_dtype = np.dtype(out_dtype)
    factor = dequantization_factors(scale_inv_a, scale_inv_b)
    q_a, q_b = keep_fp8(q_a, q_b, dimension_numbers, out_dtype)
    if not (_is_fp8(q_a) and _is_fp8(q_b)):   # widened by keep_fp8
        with jax.named_scope(WIDENED_SCOPE):
            return _scaled_product(q_a, q_b, factor, dimension_numbers, precision, out_dtype,
                                   out_sharding)
    return cast(jax.Array, _fp8_product(
        q_a, q_b, factor, dimension_numbers=dimension_numbers, precision=precision,
        out_dtype=out_dtype, out_sharding=out_sharding))


_TWO_63 = np.float32(2.0 ** 63)
_TWO_M126 = np.float32(2.0 ** -126)   # FLT_MIN, the smallest normal float32


def dequantization_factors(scale_inv_a: ArrayLike,
                           scale_inv_b: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """(c1, c2) with ``c1 * c2 == scale_inv_a * scale_inv_b``, applied to the GEMM's result
    as ``(out * c1) * c2``.

    Ordinarily c1 is the float32 product (the one folded into the GEMM) and c2 is 1, an
    exact no-op. Where the product is below the normal range (two tiny scale_invs, e.g.
    operands near 1e-20 and 1e-15), XLA would flush it to zero and with it a result
    that is itself normal; there c1 is that product times 2**126 (the same significand,
    computed from operands scaled by 2**63 each, so it stays normal) and c2 is 2**-126,
    so the result is flushed only where it is below the normal range itself.
    """
    sa, sb = (jnp.asarray(s, jnp.float32) for s in (scale_inv_a, scale_inv_b))
    # The barriers keep XLA from reassociating the powers of two into one constant
    # factor (which would bring back the flushed product) or into the GEMM's scale.
    # (lax.optimization_barrier is unannotated in JAX.)
    sa_up, sb_up = lax.optimization_barrier((sa * _TWO_63, sb * _TWO_63))  # type: ignore[no-untyped-call]
    lifted = sa_up * sb_up
    tiny = jnp.abs(lifted) < 1   # the product is below FLT_MIN
    return cast("tuple[jax.Array, jax.Array]", lax.optimization_barrier(  # type: ignore[no-untyped-call]
        (jnp.where(tiny, lifted, sa * sb), jnp.where(tiny, _TWO_M126, np.float32(1)))))


def _is_fp8(x: jax.Array) -> bool:
    return np.dtype(x.dtype) in recipe_lib.FP8_DTYPES


def _scaled_product(q_a: jax.Array, q_b: jax.Array, factor: tuple[jax.Array, jax.Array],
                    dimension_numbers: lax.DotDimensionNumbers, precision: Any,
                    out_dtype: np.dtype, out_sharding: Any) -> jax.Array:
    """The GEMM and its scaling, as `gemm` describes them; ``precision`` may be a dot
    algorithm."""
    direct = out_dtype in _DIRECT_OUT
    out = lax.dot_general(q_a, q_b, dimension_numbers, precision=precision,
                          preferred_element_type=out_dtype if direct else jnp.float32,
                          out_sharding=out_sharding)
    c1, c2 = factor
    if direct:
        return (out * c1.astype(out_dtype)) * c2.astype(out_dtype)
    return ((out * c1) * c2).astype(out_dtype)


def fp8_algorithm(precision: Any) -> lax.DotAlgorithmPreset:
    """The dot algorithm an FP8 GEMM runs with on CUDA for ``precision``: float32
    accumulation for HIGHEST, cuBLASLt's fast accumulation (its DEFAULT) otherwise."""
    highest = lax.Precision.HIGHEST in (precision if isinstance(precision, tuple)
                                        else (precision,))
    return (lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32 if highest
            else lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM)


def _cuda_fp8_product(q_a: jax.Array, q_b: jax.Array, factor: tuple[jax.Array, jax.Array], *,
                      precision: Any, **params: Any) -> jax.Array:
    """`_scaled_product` with the accumulation `precision` asks for named as a dot
    algorithm (`fp8_algorithm`)."""
    return _scaled_product(q_a, q_b, factor, precision=fp8_algorithm(precision), **params)


# The product of two FP8 operands: `_scaled_product` with ``precision`` (XLA:CPU takes no
# FP8 algorithm), on CUDA with the accumulation named as a dot algorithm. Why: for the
# same Precision XLA:GPU runs the same cuBLASLt FP8 GEMMs, but it also autotunes Triton
# FP8 kernels against them, which accumulate differently (without cuBLASLt's float32
# promotion): its autotuner checks each candidate's output against the others' and
# describes every disagreeing element on the host, at a cost in compile time; and at
# HIGHEST it could pick a Triton kernel with the coarser accumulation. With the algorithm
# only cuBLASLt's GEMMs are candidates. The frame picks the version where the GEMM is
# lowered (base.by_platform: for operands outside a jit, eagerly, under vmap or grad, their
# device's).
_fp8_product = base.by_platform(base.ByPlatform(
    "jax_fp8_fp8_gemm", _scaled_product,
    {"cuda": base.Variant(_cuda_fp8_product, "the accumulation named as a dot algorithm, "
                                             "so only cuBLASLt's FP8 GEMMs are autotuned")}))


def kernel_grad_layout(dimension_numbers: lax.DotDimensionNumbers,
                       lhs_ndim: int) -> tuple[int, ...] | None:
    """Without batch axes: the order [contracting..., free...] of lhs's axes in which the
    kernel-gradient GEMM contracts over its minor axes (cuBLASLt's FP8 GEMMs take only
    that layout). None with batch axes (the general rule is used then)."""
    (lc, _), (lb, _) = dimension_numbers
    if lb:
        return None
    return tuple(lc) + tuple(remaining(range(lhs_ndim), lc))


def lhs_for_kernel_grad(q_lhs: jax.Array,
                        dimension_numbers: lax.DotDimensionNumbers) -> jax.Array:
    """The residual for the kernel gradient: the quantized input, already transposed to
    the layout that GEMM wants (contraction over the minor axes), so the backward asks
    for no layout change. Same bytes as the untransposed residual. XLA would not fuse
    the transpose with the quantization anyway, so on CUDA it is jax_fp8's byte-transpose
    kernel (`layout.rotate_axes`), as is the gradient's in `kernel_grad`."""
    perm = kernel_grad_layout(dimension_numbers, q_lhs.ndim)
    if perm is None or perm == tuple(range(q_lhs.ndim)):
        return q_lhs
    n_c = len(dimension_numbers[0][0])
    if perm == tuple(range(q_lhs.ndim - n_c, q_lhs.ndim)) + tuple(range(q_lhs.ndim - n_c)):
        return layout.rotate_axes(q_lhs, q_lhs.ndim - n_c)  # the usual [T..., D] case
    return lax.transpose(q_lhs, perm)


def rhs_for_forward(q_rhs: jax.Array,
                    dimension_numbers: lax.DotDimensionNumbers) -> tuple[Any, Any]:
    """(rhs, dimension_numbers) for the forward GEMM with the quantized kernel's contracting
    axes made minor, as cuBLASLt's FP8 GEMMs want them. A kernel that contracts over its
    leading axes (a Dense kernel [K, N]) is rotated to [N, K] by `layout.rotate_axes`
    (jax_fp8's byte-transpose kernel on CUDA); left as it is, XLA would fuse the cast
    into a transpose for this GEMM and transpose back for the input gradient's, which
    wants the kernel as stored. Other kernels, and any with batch axes, are returned
    unchanged. Same bits either way: only the layout differs."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_c = len(rc)
    if lb or rb or not 0 < n_c < q_rhs.ndim or set(rc) != set(range(n_c)):
        return q_rhs, dimension_numbers
    n_f = q_rhs.ndim - n_c
    return (layout.rotate_axes(q_rhs, n_c),
            ((tuple(lc), tuple(n_f + int(a) for a in rc)), (tuple(lb), tuple(rb))))


def lhs_free_axes(g: jax.Array, rhs: jax.Array, rhs_contract: Sequence[int]) -> int:
    """How many leading axes of the output gradient g come from lhs (no batch axes)."""
    return g.ndim - (rhs.ndim - len(rhs_contract))


def kernel_grad(q_g: jax.Array, lhs_t: jax.Array, q_rhs: jax.Array,
                dimension_numbers: lax.DotDimensionNumbers, out_dtype: DTypeLike,
                scale_invs: tuple[Any, Any], g_t: jax.Array | None = None) -> jax.Array:
    """d(dot_general(lhs, rhs))/d rhs applied to q_g, from `lhs_for_kernel_grad`'s
    residual: both FP8 operands contract over their minor axes. Shapes, without batch
    axes: lhs_t [C..., F_l...], q_g [F_l..., F_r...] -> [C..., F_r...], returned in rhs's
    axis order. g_t: q_g already rotated to [F_r..., F_l...], if the caller has it."""
    (lc, rc), _ = dimension_numbers
    n_c, n_fl = len(lc), lhs_free_axes(q_g, q_rhs, rc)
    n_fr = q_g.ndim - n_fl
    if g_t is None:
        g_t = layout.rotate_axes(q_g, n_fl)
    dims = ((tuple(range(n_c, lhs_t.ndim)), tuple(range(n_fr, g_t.ndim))), ((), ()))
    rhs_free = remaining(range(q_rhs.ndim), rc)
    unsorted_axes = list(rc) + rhs_free
    out = gemm(lhs_t, g_t, dims, *scale_invs, out_dtype, precision=lax.Precision.HIGHEST,
               out_sharding=permuted_sharding(q_rhs, unsorted_axes, like=(lhs_t, g_t)))
    return lax.transpose(out, tuple(int(a) for a in np.argsort(unsorted_axes)))


