"""Correctly rounded float32 quotients from one float64 division, emitted in the lowering.

XLA:GPU's float32 division is not correctly rounded (up to 2 ulp off); its float64
division is IEEE's, as XLA:CPU's is. float64 carries 53 > 2 * 24 + 2 significand bits, so
the float64 quotient of two float32 values, rounded again to float32, is the correctly
rounded float32 quotient: rounding twice gives the same bits as rounding once (the exact
quotient of two 24-bit significands never lies within float64's rounding error of a
float32 midpoint unless it is one). The same holds for rounding the quotient to an
integer below 2**24. JAX without x64 has no float64 arrays, so the float64 values exist
only inside the lowering: a primitive, ``quotient_p``, whose lowering converts to float64,
divides and converts back.

Shapes: a, b [...] float32 (broadcast against each other) -> [...].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import ad, batching, mlir

from jax_fp8._primitives import common

ROUNDINGS = ("float32", "integer")


def divide_rn(a, b):
    """a / b in float32, rounded to nearest even; a quotient above float32's range is inf.
    Exact for normal and zero quotients; where the quotient is a float32 subnormal, XLA
    may flush it to zero (use `divide_rn_to_integer` on the scaled operands there)."""
    return _bind(a, b, "float32")


def divide_rn_to_integer(a, b):
    """a / b rounded to the nearest integer (half to even), as uint32, for 0 <= a / b <
    2**24 - 1/2 (elsewhere the result is unspecified)."""
    return _bind(a, b, "integer")


def _bind(a, b, rounding):
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    a, b = common.vary_like([a, b])
    return quotient_p.bind(a, b, rounding=rounding)


def _abstract_eval(a, b, *, rounding):
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    common.check_same_varying("quotient", (a, b))
    dtype = jnp.float32 if rounding == "float32" else jnp.uint32
    return a.update(dtype=np.dtype(dtype), weak_type=False)


def _lowering(ctx, a, b, *, rounding):
    (aval,) = ctx.avals_out
    f64 = ir.RankedTensorType.get(aval.shape, ir.F64Type.get())
    q = hlo.divide(hlo.convert(f64, a), hlo.convert(f64, b))
    if rounding == "integer":
        q = hlo.round_nearest_even(q)
    element = (ir.F32Type.get() if rounding == "float32"
               else ir.IntegerType.get_unsigned(32))
    return [hlo.convert(ir.RankedTensorType.get(aval.shape, element), q)]


def _batch(args, dims, *, rounding):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    return quotient_p.bind(*args, rounding=rounding), 0


def _jvp(primals, tangents, **params):
    """Piecewise constant in float32, as the integer arithmetic it replaced was: zero
    tangents."""
    del tangents
    out = quotient_p.bind(*primals, **params)
    return out, ad.Zero(jax.typeof(out).to_tangent_aval())


quotient_p = Primitive("jax_fp8_quotient")
quotient_p.def_impl(common.eager_impl(quotient_p))
quotient_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(quotient_p, _lowering)
batching.primitive_batchers[quotient_p] = _batch
ad.primitive_jvps[quotient_p] = _jvp
