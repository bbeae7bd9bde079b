"""Bit-exact float32 arithmetic of current and block scaling in jax.numpy.

The arithmetic is docs/semantics.md's ("Current and blockwise scaling"). XLA flushes
float32 subnormals to zero in its own code (CPU and GPU), while the semantics keep them.
So nothing here feeds a subnormal to a float operation: amaxes are integer maxima of the
bits of |x|, float16/bfloat16 are widened through their bits, a subnormal x is scaled up
by 2**64 exactly (from its integer significand) before the multiply, and divisions are
float64 divisions rounded to float32 in integers (`quotient.py`; XLA:GPU's float32
division is not correctly rounded), subnormal 1/scale included. The results are the IEEE
float32 results, the same bits as the CUDA kernel (ffi/block_quantize_cuda.cu) and the
NumPy oracle (tests/block_reference.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives.quotient import divide_rn, quotient_bits

F32 = np.float32
U32 = np.uint32
_SIGN, _MAG, _INF = U32(0x80000000), U32(0x7FFFFFFF), U32(0x7F800000)
_MIN_NORMAL, _FLT_MAX = U32(0x00800000), U32(0x7F7FFFFF)
_ONE, _POW2 = U32(0x3F800000), U32(0xFF800000)


def to_bits(x: jax.Array) -> jax.Array:
    """The bits of a float32 array, as uint32."""
    return lax.bitcast_convert_type(x, jnp.uint32)


def from_bits(u: jax.Array) -> jax.Array:
    """The float32 array whose bits are the uint32 u."""
    return lax.bitcast_convert_type(u, jnp.float32)


def widen(x: jax.Array) -> jax.Array:
    """x (float32, bfloat16 or float16) as float32, exactly: subnormals stay subnormals."""
    dtype = np.dtype(x.dtype)
    if dtype == np.float32:
        return x
    u = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if dtype == jnp.bfloat16:
        return from_bits(u << 16)
    if dtype == np.float16:
        sign = (u & U32(0x8000)) << 16
        exp, man = (u >> 10) & U32(0x1F), u & U32(0x3FF)
        normal = sign | ((exp + U32(112)) << 23) | (man << 13)
        special = sign | _INF | (man << 13)
        # A float16 subnormal man * 2**-24 is a float32 normal: exact in float arithmetic.
        tiny = to_bits(man.astype(jnp.int32).astype(jnp.float32) * F32(2.0 ** -24)) | sign
        return from_bits(jnp.where(exp == 0, tiny, jnp.where(exp == 31, special, normal)))
    raise TypeError(f"x must be float32, bfloat16 or float16, got {dtype}")


def abs_bits(x32: jax.Array) -> jax.Array:
    """The bits of |x| with NaN as 0: their unsigned order is the order of the values."""
    mag = to_bits(x32) & _MAG
    return jnp.where(mag > _INF, U32(0), mag)


def scale_from_amax_f32(amax: ArrayLike, fp8_max: float, amax_epsilon: float = 0.0,
                        power_of_2_scale: bool = False) -> jax.Array:
    """The scale from a float32 amax (any shape), as IEEE float32 bits (docs/semantics.md,
    "Scale from an amax")."""
    a = to_bits(jnp.asarray(amax, jnp.float32))
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
    q = to_bits(divide_rn(F32(fp8_max), from_bits(jnp.where(one | tiny, _ONE, a))))
    s = jnp.where(one, _ONE, jnp.where(tiny | (q == _INF), _FLT_MAX, q))
    if power_of_2_scale:
        s = s & _POW2
    return from_bits(s)


def scale_inverse(scale: jax.Array) -> jax.Array:
    """1 / scale, correctly rounded, also where the result is subnormal (scale > 2**126).
    For a zero, infinite, NaN or subnormal scale the result is XLA's."""
    b = to_bits(scale)
    sign, mag = b & _SIGN, b & _MAG
    e = mag >> 23
    finite = (e >= 1) & (e <= 254)
    exact = quotient_bits(F32(1.0), from_bits(jnp.where(finite, mag, _ONE)))
    plain = to_bits(F32(1.0) / from_bits(jnp.where(finite, _ONE, mag)))
    return from_bits(jnp.where(finite, exact, plain) | sign)


def pow2_inverse(scale: jax.Array) -> jax.Array:
    """1 / scale for a power of two scale = 2**(e - 127), 1 <= e <= 254, on its bits."""
    e = to_bits(scale) >> 23
    return from_bits(jnp.where(e <= 253, (U32(254) - e) << 23, U32(1) << 22))


def up_scaled(v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(v * 2**64, 2**-64) where v is subnormal, else (v, 1): both factors normal, and
    their product v exactly (for a float32 v >= 0)."""
    mag = to_bits(v) & _MAG
    sub = (mag != 0) & (mag < _MIN_NORMAL)
    up = mag.astype(jnp.int32).astype(jnp.float32) * F32(2.0 ** -85)
    return jnp.where(sub, up, v), jnp.where(sub, F32(2.0 ** -64), F32(1.0))


def nan_byte(fp8_dtype: DTypeLike) -> tuple[int, bool]:
    """(the quantized byte of a NaN, whether x's sign is or-ed in) for an FP8 dtype."""
    dtype = np.dtype(fp8_dtype)
    if dtype.name.endswith("fnuz"):
        return 0x80, False
    return (0x7E if dtype == jnp.float8_e5m2 else 0x7F), True


def cast_scaled(x32: jax.Array, scale: jax.Array, fp8_dtype: DTypeLike) -> jax.Array:
    """saturate_cast(x * scale) with IEEE float32 arithmetic (x and scale broadcast):
    clip to +-fp8_max, round to nearest even; a NaN x gives the type's quiet NaN (0x7F /
    0x7E for E4M3 / E5M2, with x's sign)."""
    fp8_dtype = np.dtype(fp8_dtype)
    fmax = F32(recipe_lib.fp8_max(fp8_dtype))
    u = to_bits(x32)
    mag, sign = u & _MAG, u & _SIGN
    sub = (mag != 0) & (mag < _MIN_NORMAL)
    # x * 2**64, exact and normal, from the integer significand of a subnormal x
    x_up = from_bits(to_bits(mag.astype(jnp.int32).astype(jnp.float32) * F32(2.0 ** -85)) | sign)
    y = jnp.where(sub, x_up * (scale * F32(2.0 ** -64)), x32 * scale)
    q = lax.bitcast_convert_type(jnp.clip(y, -fmax, fmax).astype(fp8_dtype), jnp.uint8)
    byte, signed = nan_byte(fp8_dtype)
    nan = U32(byte) | (sign >> 24 if signed else U32(0))
    q = jnp.where(mag > _INF, nan.astype(jnp.uint8), q)
    return lax.bitcast_convert_type(q, fp8_dtype)
