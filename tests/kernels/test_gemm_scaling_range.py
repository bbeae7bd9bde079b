"""An FP8 GEMM's result stays representable whenever ``x @ w`` is: two tiny scale_invs
whose product is below the normal float32 range (which XLA flushes to zero) no longer
zero a normal result, for current and delayed scaling, forward and both gradients, on
the CPU and (marked gpu) through cuBLASLt's FP8 GEMMs; ordinary cases keep their bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_fp8
from jax_fp8 import Fp8Meta, ScalingState
from jax_fp8.gemm import _gemms

F32 = np.float32
DN = (((1,), (0,)), ((), ()))
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _delayed_meta(amax_x, amax_w, amax_g):
    """Scales as current scaling would pick them (fp8_max / amax)."""
    def st(amax, dtype):
        s = F32(jax_fp8.fp8_max(dtype)) / F32(amax)
        return ScalingState(np.zeros((4,), F32), np.asarray(s), np.asarray(F32(1) / s),
                            fp8_dtype=dtype)
    return Fp8Meta(st(amax_x, E4M3), st(amax_w, E4M3), st(amax_g, E5M2))


METAS = {
    "current": lambda: Fp8Meta.create(jax_fp8.Float8CurrentScaling()),
    "delayed": lambda: _delayed_meta(1e-20, 1e-15, 1e-15),
    "block": lambda: Fp8Meta.create(jax_fp8.Float8BlockScaling()),
}


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recipe", sorted(METAS))
def test_tiny_operands_give_the_normal_product(backend, device, recipe, out_dtype):
    """The issue's example: x = 1e-20, w = 1e-15 everywhere, [16, 16] (x @ w = 1.6e-34,
    normal); the cotangent c = 1e-15, so dw = x^T c = 1.6e-34 too. Constant operands
    quantize to 448 (E4M3) and 57344 (E5M2) up to the scale's rounding, so each result
    is within E4M3's relative rounding (2**-4 per operand) of the exact one, plus the
    output dtype's."""
    x = np.full((16, 16), 1e-20, F32)
    w = np.full((16, 16), 1e-15, F32)
    c = np.full((16, 16), 1e-15, F32)
    meta = METAS[recipe]()

    def f(x, w):
        out, _ = jax_fp8.fp8_dot_general(x.astype(out_dtype), w.astype(out_dtype), DN, meta,
                                         preferred_element_type=out_dtype)
        return jnp.sum(out.astype(jnp.float32) * c), out

    with jax_fp8.frozen_scales():
        (_, out), (dx, dw) = helpers.run_on(
            device, jax.value_and_grad(f, argnums=(0, 1), has_aux=True), x, w)
    x64, w64, c64 = (a.astype(np.float64) for a in (x, w, c))
    for what, got, want in (("out", out, x64 @ w64), ("dx", dx, c64 @ w64.T),
                            ("dw", dw, x64.T @ c64)):
        got = np.asarray(got, np.float64)
        assert np.all(got != 0), (what, got[0, 0])
        np.testing.assert_array_less(np.abs(got - want), 0.14 * np.abs(want), err_msg=what)


def test_dequantization_factors_ordinary_bits_and_tiny_products():
    """Ordinarily (the product of the scale_invs normal) the factors are that float32
    product and exactly 1, the bits the GEMM's result had before; below the normal range
    the first is the correctly rounded product times 2**126 and the second 2**-126."""
    rng = np.random.default_rng(0)
    sa = (rng.uniform(0.5, 2, 512) * np.exp2(rng.integers(-100, 60, 512))).astype(F32)
    sb = (rng.uniform(0.5, 2, 512) * np.exp2(rng.integers(-100, 60, 512))).astype(F32)
    c1, c2 = jax.jit(jax.vmap(_gemms.dequantization_factors))(sa, sb)
    c1, c2 = np.asarray(c1), np.asarray(c2)
    exact = sa.astype(np.float64) * sb.astype(np.float64)     # exact: 48 significant bits
    normal = exact >= np.finfo(F32).tiny
    assert normal.any() and (~normal).any()
    np.testing.assert_array_equal(c1[normal], (sa * sb)[normal])
    np.testing.assert_array_equal(c2[normal], F32(1))
    np.testing.assert_array_equal(c1[~normal], (exact[~normal] * 2.0**126).astype(F32))
    np.testing.assert_array_equal(c2[~normal], F32(2.0**-126))


def test_ordinary_delayed_scaling_bits_unchanged():
    """With ordinary scales the result is the FP8 GEMM's times the float32 product of the
    scale_invs, one multiply (the second factor is exactly 1): the bits of
    ``dot_general(q_x, q_w) * (scale_inv_x * scale_inv_w)``."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 64)).astype(F32)
    w = rng.normal(size=(64, 48)).astype(F32)
    meta = _delayed_meta(3.0, 2.5, 1.0)

    def want(x, w):
        qx, qw = jax_fp8.quantize(x, meta.input), jax_fp8.quantize(w, meta.kernel)
        gemm = jax.lax.dot_general(qx, qw, DN, preferred_element_type=jnp.float32)
        return gemm * (meta.input.scale_inv * meta.kernel.scale_inv)

    with jax.default_device(jax.devices("cpu")[0]):
        out, _ = jax.jit(lambda x, w: jax_fp8.fp8_dot_general(x, w, DN, meta))(x, w)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(want)(x, w)))
