"""Quantization from the tensor's own amax: bit-exact jax.numpy math and the `jax_fp8_block_quantize` primitive.

The arithmetic is docs/semantics.md's ("Current and blockwise scaling"). XLA flushes
float32 subnormals to zero in its own code (CPU and GPU), while the semantics keep them. So the math here never feeds a subnormal to a float operation: amaxes are integer
maxima of the bits of |x|, float16/bfloat16 are widened through their bits, a subnormal x
is scaled up by 2**64 exactly (from its integer significand) before the multiply, and
divisions are float64 divisions rounded to float32 in integers (`quotient.py`; XLA:GPU's
float32 division is not correctly rounded), subnormal 1/scale included. The results are
the IEEE float32 results, the same bits as the CUDA kernel (ffi/block_quantize_cuda.cu)
and the NumPy oracle (tests/block_reference.py).

The primitive: x [..., M, K] -> the row-wise copy (q [..., M, K], scale_inv
[..., M or ceil(M/128), ceil(K/128)]), the column-wise copy (the same for x with its last two
axes swapped: q_t [..., K, M], scale_inv_t) or both from one read of x. On CUDA one custom
call (one kernel); elsewhere, under a multi-device jit (XLA partitions the jax.numpy ops),
for FP8 types the kernel does not write, or with ``implementation="jnp"``, the math below.

``scale_layout="gemm"`` gives each scale_inv in the layout the block GEMM reads
(``gemm_scale_shape``, padded with 1.0), which the kernel writes directly: the FP8 dot
needs no XLA op between its quantization and its GEMMs. ``to_gemm_layout`` /
``from_gemm_layout`` convert.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import base, common
from jax_fp8._primitives.quotient import divide_rn, quotient_bits

F32 = np.float32
U32 = np.uint32
BLOCK = 128
_SIGN, _MAG, _INF = U32(0x80000000), U32(0x7FFFFFFF), U32(0x7F800000)
_MIN_NORMAL, _FLT_MAX, _ONE, _POW2 = U32(0x00800000), U32(0x7F7FFFFF), U32(0x3F800000), U32(0xFF800000)
INPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
KERNEL_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def _bits(x):
    return lax.bitcast_convert_type(x, jnp.uint32)


def _f32(u):
    return lax.bitcast_convert_type(u, jnp.float32)


def widen(x):
    """x (float32, bfloat16 or float16) as float32, exactly: subnormals stay subnormals."""
    dtype = np.dtype(x.dtype)
    if dtype == np.float32:
        return x
    u = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if dtype == jnp.bfloat16:
        return _f32(u << 16)
    if dtype == np.float16:
        sign = (u & U32(0x8000)) << 16
        exp, man = (u >> 10) & U32(0x1F), u & U32(0x3FF)
        normal = sign | ((exp + U32(112)) << 23) | (man << 13)
        special = sign | _INF | (man << 13)
        # A float16 subnormal man * 2**-24 is a float32 normal: exact in float arithmetic.
        tiny = _bits(man.astype(jnp.int32).astype(jnp.float32) * F32(2.0 ** -24)) | sign
        return _f32(jnp.where(exp == 0, tiny, jnp.where(exp == 31, special, normal)))
    raise TypeError(f"x must be float32, bfloat16 or float16, got {dtype}")


def abs_bits(x32):
    """The bits of |x| with NaN as 0: their unsigned order is the order of the values."""
    mag = _bits(x32) & _MAG
    return jnp.where(mag > _INF, U32(0), mag)


def scale_from_amax_f32(amax, fp8_max: float, amax_epsilon: float = 0.0,
                        power_of_2_scale: bool = False):
    """The scale from a float32 amax (any shape), as IEEE float32 bits (docs/semantics.md,
    "Scale from an amax")."""
    a = _bits(jnp.asarray(amax, jnp.float32))
    mag, neg = a & _MAG, (a & _SIGN) != 0
    eps = U32(np.asarray(F32(amax_epsilon)).view(np.uint32))
    # amax < epsilon (epsilon >= 0), compared on bits: NaN never is, a negative amax is
    # unless both are zeros.
    below = (mag <= _INF) & jnp.where(neg, (mag != 0) | (eps != 0), mag < eps)
    a = jnp.where(below, eps, a)
    mag = a & _MAG
    one = (mag == 0) | (mag >= _INF)               # zero, inf, NaN: scale 1
    tiny = (mag != 0) & (mag < _MIN_NORMAL)          # fp8_max / subnormal overflows
    # Elsewhere a is a positive normal and the quotient a normal or inf: no subnormal
    # reaches the division.
    q = _bits(divide_rn(F32(fp8_max), _f32(jnp.where(one | tiny, _ONE, a))))
    s = jnp.where(one, _ONE, jnp.where(tiny | (q == _INF), _FLT_MAX, q))
    if power_of_2_scale:
        s = s & _POW2
    return _f32(s)


def scale_inverse(scale):
    """1 / scale, correctly rounded, also where the result is subnormal (scale > 2**126).
    For a zero, infinite, NaN or subnormal scale the result is XLA's."""
    b = _bits(scale)
    sign, mag = b & _SIGN, b & _MAG
    e = mag >> 23
    finite = (e >= 1) & (e <= 254)
    exact = quotient_bits(F32(1.0), _f32(jnp.where(finite, mag, _ONE)))
    plain = _bits(F32(1.0) / _f32(jnp.where(finite, _ONE, mag)))
    return _f32(jnp.where(finite, exact, plain) | sign)


def pow2_inverse(scale):
    """1 / scale for a power of two scale = 2**(e - 127), 1 <= e <= 254, on its bits."""
    e = _bits(scale) >> 23
    return _f32(jnp.where(e <= 253, (U32(254) - e) << 23, U32(1) << 22))


def up_scaled(v):
    """(v * 2**64, 2**-64) where v is subnormal, else (v, 1): both factors normal, and
    their product v exactly (for a float32 v >= 0)."""
    mag = _bits(v) & _MAG
    sub = (mag != 0) & (mag < _MIN_NORMAL)
    up = mag.astype(jnp.int32).astype(jnp.float32) * F32(2.0 ** -85)
    return jnp.where(sub, up, v), jnp.where(sub, F32(2.0 ** -64), F32(1.0))


def nan_byte(fp8_dtype) -> tuple[int, bool]:
    """(the quantized byte of a NaN, whether x's sign is or-ed in) for an FP8 dtype."""
    dtype = np.dtype(fp8_dtype)
    if dtype.name.endswith("fnuz"):
        return 0x80, False
    return (0x7E if dtype == jnp.float8_e5m2 else 0x7F), True


def cast_scaled(x32, scale, fp8_dtype):
    """saturate_cast(x * scale) with IEEE float32 arithmetic (x and scale broadcast):
    clip to +-fp8_max, round to nearest even; a NaN x gives the type's quiet NaN (0x7F /
    0x7E for E4M3 / E5M2, with x's sign)."""
    fp8_dtype = np.dtype(fp8_dtype)
    fmax = F32(recipe_lib.fp8_max(fp8_dtype))
    u = _bits(x32)
    mag, sign = u & _MAG, u & _SIGN
    sub = (mag != 0) & (mag < _MIN_NORMAL)
    # x * 2**64, exact and normal, from the integer significand of a subnormal x
    x_up = _f32(_bits(mag.astype(jnp.int32).astype(jnp.float32) * F32(2.0 ** -85)) | sign)
    y = jnp.where(sub, x_up * (scale * F32(2.0 ** -64)), x32 * scale)
    q = lax.bitcast_convert_type(jnp.clip(y, -fmax, fmax).astype(fp8_dtype), jnp.uint8)
    byte, signed = nan_byte(fp8_dtype)
    nan = U32(byte) | (sign >> 24 if signed else U32(0))
    q = jnp.where(mag > _INF, nan.astype(jnp.uint8), q)
    return lax.bitcast_convert_type(q, fp8_dtype)


def scale_rows(m: int, block_rows: int) -> int:
    return m if block_rows == 1 else -(-m // block_rows)


SCALE_LAYOUTS = ("spec", "gemm")


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def gemm_scale_shape(shape, block_rows: int) -> tuple:
    """The block GEMM's (cuBLASLt's) scale_inv shape for an operand [..., R, K], the
    layout of ffi/block_scale_layout.h: 1x128 blocks [..., ceil(K/128), round_up(R, 4)]
    (R contiguous), 128x128 tiles [..., ceil(R/128), round_up(ceil(K/128), 4)]."""
    *lead, r, k = shape
    kb = -(-k // BLOCK)
    tail = (kb, _round4(r)) if block_rows == 1 else (-(-r // BLOCK), _round4(kb))
    return tuple(lead) + tail


def scale_shape(shape, block_rows: int, layout: str = "spec") -> tuple:
    """scale_inv's shape for an operand [..., R, K] in either layout."""
    if layout == "gemm":
        return gemm_scale_shape(shape, block_rows)
    *lead, r, k = shape
    return tuple(lead) + (scale_rows(r, block_rows), -(-k // BLOCK))


def to_gemm_layout(scale_inv, block_rows: int):
    """scale_inv [..., R or ceil(R/128), ceil(K/128)] in the GEMM layout (padded with 1.0)."""
    s = jnp.swapaxes(scale_inv, -1, -2) if block_rows == 1 else scale_inv
    pad = _round4(s.shape[-1]) - s.shape[-1]
    if pad:
        s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)], constant_values=1.0)
    return s


def from_gemm_layout(scale_inv, block_rows: int, r: int, k: int):
    """The inverse of to_gemm_layout for an operand [..., r, k]."""
    if block_rows == 1:
        return jnp.swapaxes(scale_inv[..., :r], -1, -2)
    kb = -(-k // BLOCK)
    return scale_inv[..., :kb]


def quantize_reference(x, *, block_rows: int, fp8_dtype, power_of_2_scale: bool,
                       amax_epsilon: float):
    """x [..., M, K] -> (q [..., M, K], scale_inv [..., M or ceil(M/128), ceil(K/128)])."""
    *lead, m, k = x.shape
    lead, b = tuple(lead), math.prod(lead)
    mb, kb = -(-m // block_rows), -(-k // BLOCK)
    pad = [(0, 0), (0, mb * block_rows - m), (0, kb * BLOCK - k)]
    xp = jnp.pad(widen(x.reshape(b, m, k)), pad).reshape(b, mb, block_rows, kb, BLOCK)
    amax = jnp.max(abs_bits(xp), axis=(2, 4), initial=U32(0))
    scale = scale_from_amax_f32(_f32(amax), recipe_lib.fp8_max(fp8_dtype), amax_epsilon,
                                power_of_2_scale)
    q = lax.bitcast_convert_type(cast_scaled(xp, scale[:, :, None, :, None], fp8_dtype),
                                 jnp.uint8)
    # The padding is cut off as bytes: XLA:CPU (jax 0.11) slices FP8 arrays through a
    # float conversion that rewrites every E5M2 NaN as 0x7F.
    q = q.reshape(b, mb * block_rows, kb * BLOCK)[:, :m, :k].reshape(x.shape)
    q = lax.bitcast_convert_type(q, fp8_dtype)
    inverse = pow2_inverse(scale) if power_of_2_scale else scale_inverse(scale)
    return q, inverse.reshape(lead + (mb, kb))


# --------------------------------------------------------------------------- primitive

TARGET = "jax_fp8_block_quantize"


def _like(x, shape, dtype):
    return x.update(shape=shape, dtype=dtype, weak_type=False)


def _abstract_eval(x, *, block_rows, fp8_dtype, power_of_2_scale, amax_epsilon, rowwise,
                   colwise, scale_layout):
    del power_of_2_scale, amax_epsilon
    common.check_not_explicit("jax_fp8_block_quantize", x)
    if x.ndim < 2 or np.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(f"jax_fp8_block_quantize: takes a float32/bfloat16/float16 array of "
                        f"rank >= 2, got {x.dtype}{list(x.shape)}")
    if block_rows not in (1, BLOCK) or not (rowwise or colwise) or \
            scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"jax_fp8_block_quantize: bad parameters block_rows={block_rows}, "
                         f"rowwise={rowwise}, colwise={colwise}, scale_layout={scale_layout}")
    *lead, m, k = x.shape
    lead = tuple(lead)
    outs = []
    if rowwise:
        outs += [_like(x, lead + (m, k), fp8_dtype),
                 _like(x, scale_shape(lead + (m, k), block_rows, scale_layout), np.float32)]
    if colwise:
        outs += [_like(x, lead + (k, m), fp8_dtype),
                 _like(x, scale_shape(lead + (k, m), block_rows, scale_layout), np.float32)]
    return outs


def _reference(x, *, block_rows, fp8_dtype, power_of_2_scale, amax_epsilon, rowwise, colwise,
               scale_layout):
    opts = dict(block_rows=block_rows, fp8_dtype=fp8_dtype, power_of_2_scale=power_of_2_scale,
                amax_epsilon=amax_epsilon)
    outs = []
    for wanted, a in ((rowwise, x), (colwise, jnp.swapaxes(x, -1, -2))):
        if wanted:
            q, s = quantize_reference(a, **opts)
            outs += [q, to_gemm_layout(s, block_rows) if scale_layout == "gemm" else s]
    return outs


def kernel_takes(shape, dtype, fp8_dtype) -> bool:
    """Whether the CUDA kernel takes x (as ffi/block_quantize_cuda.cu's BlockQuantizeSupports:
    at most 2**31 - 1 tiles of 128 rows and of 128 columns)."""
    *lead, m, k = shape
    return (np.dtype(dtype) in INPUT_DTYPES and np.dtype(fp8_dtype) in KERNEL_FP8
            and m > 0 and k > 0 and math.prod(lead) > 0 and -(-k // BLOCK) < 2 ** 31
            and math.prod(lead) * -(-m // BLOCK) < 2 ** 31)


def _kernel_lowering(ctx, x, *, block_rows, fp8_dtype, power_of_2_scale, amax_epsilon, rowwise,
                     colwise, scale_layout):
    del fp8_dtype
    return jax.ffi.ffi_lowering(TARGET)(
        ctx, x, tile_2d=block_rows == BLOCK, rowwise=bool(rowwise), colwise=bool(colwise),
        amax_epsilon=F32(amax_epsilon), power_of_2_scale=bool(power_of_2_scale),
        gemm_layout=scale_layout == "gemm")


# Quantization is not differentiated (stop-gradient): zero tangents. Leading axes are
# independent tensors: batched in front.
block_quantize_p = base.register(base.Spec(
    TARGET, _abstract_eval, _reference, multiple_results=True, cache_reference=True,
    kernels={"cuda": base.Kernel(
        _kernel_lowering,
        takes=lambda x, *, fp8_dtype, **_: kernel_takes(x.shape, x.dtype, fp8_dtype))}))


def block_quantize(x, *, block_rows, fp8_dtype, power_of_2_scale, amax_epsilon, rowwise=True,
                   colwise=False, implementation="auto", scale_layout="spec"):
    """Binds the primitive (see the module docstring for the results); `implementation`
    is one of base.IMPLEMENTATIONS."""
    return block_quantize_p.bind(
        x, block_rows=int(block_rows), fp8_dtype=np.dtype(fp8_dtype),
        power_of_2_scale=bool(power_of_2_scale), amax_epsilon=float(amax_epsilon),
        rowwise=bool(rowwise), colwise=bool(colwise), implementation=implementation,
        scale_layout=scale_layout)
