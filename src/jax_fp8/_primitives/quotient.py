"""Correctly rounded float32 quotients (and products) from one float64 division (or product),
emitted in the lowering.

XLA:GPU's float32 division is not correctly rounded (up to 2 ulp off); float64 division is
IEEE's on XLA's backends. float64 carries 53 > 2 * 24 + 2 significand bits, so the float64
quotient of two float32 values, rounded again to float32, is the correctly rounded float32
quotient (rounding twice gives the bits of rounding once: the exact quotient of two 24-bit
significands is never within float64's rounding error of a float32 midpoint unless it is
one), subnormal quotients included. Two things must not touch the float64 value:

* below HLO, ``convert_f32(divide(convert_f64(a), convert_f64(b)))`` may become a float32
  division (a rewrite that is exact in IEEE arithmetic, so a compiler may make it), which
  XLA:GPU's float32 division rounds inexactly. So the quotient leaves float64 as its bits
  (a bitcast to uint64), never through a float convert;
* XLA flushes float32 subnormals in its own conversions (CPU), so the rounding to float32
  is integer arithmetic on those bits, and the result is the float32 bits (uint32).

JAX without x64 has no float64 arrays: the float64 values exist only inside the lowering
of the primitive ``quotient_bits_p``.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.typing import ArrayLike

from jax_fp8._primitives import base


def quotient_bits(a: ArrayLike, b: ArrayLike, *, subnormal: bool = True) -> jax.Array:
    """The bits (uint32) of a / b in float32, rounded to nearest even: subnormal quotients
    exact, overflow to inf, a NaN operand or 0/0 a quiet NaN. a and b are read as XLA reads
    float32 values (a subnormal operand may be read as zero). ``subnormal=False``: fewer
    operations, for quotients known to be normal or to overflow (others unspecified).
    Shapes: a, b [...] float32 (broadcast against each other) -> [...] uint32."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return cast(jax.Array, quotient_bits_p.bind(a, b, subnormal=bool(subnormal)))


def divide_rn(a: ArrayLike, b: ArrayLike) -> jax.Array:
    """a / b in float32, correctly rounded, for a quotient that is normal or overflows
    (to inf); zero, subnormal and NaN quotients unspecified (`quotient_bits` has them)."""
    return jax.lax.bitcast_convert_type(quotient_bits(a, b, subnormal=False), jnp.float32)


def product_bits(a: ArrayLike, b: ArrayLike, c: ArrayLike) -> jax.Array:
    """The bits (uint32) of a * b * c in float32, rounded once to nearest even (subnormal
    results exact), for a, b, c float32 values XLA reads as they are (normal: scale a
    subnormal up by a power of two in c) whose float64 product is exact (a * b: 48
    significand bits; c a power of two). Shapes: a, b, c broadcast -> [...] uint32."""
    a, b, c = jnp.broadcast_arrays(*(jnp.asarray(v, jnp.float32) for v in (a, b, c)))
    return cast(jax.Array, product_bits_p.bind(a, b, c))


def _abstract_eval(a: ShapedArray, *others: ShapedArray, **params: Any) -> ShapedArray:
    del others, params
    # ShapedArray.update is unannotated in JAX.
    return cast(ShapedArray, a.update(dtype=np.dtype(np.uint32), weak_type=False))  # type: ignore[no-untyped-call]


def _lowering(ctx: Any, a: ir.Value[Any], b: ir.Value[Any], *, subnormal: bool
              ) -> list[ir.Value[Any]]:
    f64 = ir.RankedTensorType.get(ctx.avals_out[0].shape, ir.F64Type.get())
    return _rounded(ctx, hlo.divide(hlo.convert(f64, a), hlo.convert(f64, b)), subnormal)


def _product_lowering(ctx: Any, a: ir.Value[Any], b: ir.Value[Any], c: ir.Value[Any]
                      ) -> list[ir.Value[Any]]:
    f64 = ir.RankedTensorType.get(ctx.avals_out[0].shape, ir.F64Type.get())
    ab = hlo.multiply(hlo.convert(f64, a), hlo.convert(f64, b))
    return _rounded(ctx, hlo.multiply(ab, hlo.convert(f64, c)), True)


def _rounded(ctx: Any, q: ir.Value[Any], subnormal: bool) -> list[ir.Value[Any]]:
    """The float64 value q as float32 bits (uint32), rounded to nearest even in integers."""
    (aval,) = ctx.avals_out
    shape = aval.shape
    u64 = ir.IntegerType.get_unsigned(64)
    u32 = ir.RankedTensorType.get(shape, ir.IntegerType.get_unsigned(32))

    def c(v: int) -> ir.Value[Any]:
        return hlo.constant(ir.DenseElementsAttr.get_splat(
            ir.RankedTensorType.get(shape, u64), ir.IntegerAttr.get(u64, int(v))))

    u = hlo.bitcast_convert(ir.RankedTensorType.get(shape, u64), q)
    sign = hlo.shift_left(hlo.shift_right_logical(u, c(63)), c(31))
    mag = hlo.and_(u, c(2 ** 63 - 1))
    # Normal float32 range (and overflow): drop 29 significand bits, rounding half to even
    # (a carry moves into the exponent, as it should), rebias the exponent by 1023 - 127.
    odd = hlo.and_(hlo.shift_right_logical(mag, c(29)), c(1))
    normal = hlo.subtract(
        hlo.shift_right_logical(hlo.add(mag, hlo.add(c(2 ** 28 - 1), odd)), c(29)),
        c(896 << 23))
    normal = hlo.minimum(normal, c(0x7F800000))            # past FLT_MAX: inf
    if not subnormal:
        return [hlo.convert(u32, hlo.or_(normal, sign))]
    # Below 2**-126: the float32 subnormal significand round(q * 2**149), from the 53-bit
    # significand m = q * 2**(1075 - exp) shifted right by 926 - exp.
    exp = hlo.shift_right_logical(mag, c(52))
    m = hlo.or_(hlo.and_(mag, c(2 ** 52 - 1)), c(2 ** 52))
    shift = hlo.minimum(hlo.subtract(c(926), hlo.minimum(exp, c(896))), c(63))
    kept = hlo.shift_right_logical(m, shift)
    rest = hlo.and_(m, hlo.subtract(hlo.shift_left(c(1), shift), c(1)))
    half = hlo.shift_left(c(1), hlo.subtract(shift, c(1)))
    gt = hlo.compare(rest, half, hlo.ComparisonDirectionAttr.get("GT"))
    tie = hlo.and_(hlo.compare(rest, half, hlo.ComparisonDirectionAttr.get("EQ")),
                   hlo.compare(hlo.and_(kept, c(1)), c(1),
                               hlo.ComparisonDirectionAttr.get("EQ")))
    up = hlo.convert(ir.RankedTensorType.get(shape, u64), hlo.or_(gt, tie))
    tiny = hlo.add(kept, up)
    is_normal = hlo.compare(exp, c(897), hlo.ComparisonDirectionAttr.get("GE"))
    is_nan = hlo.compare(mag, c(0x7FF0000000000000), hlo.ComparisonDirectionAttr.get("GT"))
    bits = hlo.select(is_nan, c(0x7FC00000), hlo.select(is_normal, normal, tiny))
    return [hlo.convert(u32, hlo.or_(bits, sign))]


# Integer bits: zero (float0) tangents; the float32 arithmetic around them is piecewise
# constant.
quotient_bits_p = base.register(base.Spec(
    "jax_fp8_quotient_bits", _abstract_eval, reference_lowering=_lowering, same_varying=True))
product_bits_p = base.register(base.Spec(
    "jax_fp8_product_bits", _abstract_eval, reference_lowering=_product_lowering,
    same_varying=True))
