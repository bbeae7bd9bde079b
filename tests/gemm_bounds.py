"""The error bounds of the FP8 GEMMs against the exact (float64) product of their dequantized
operands, shared by the GEMM tests (tests/kernels/test_block_gemm.py derives them in its
docstring) and the recipe tests; and the exact products of a recipe's three GEMMs.

Notation: E_ij = sum_k a_ik b_jk in float64, S_ij = sum_k |a_ik| |b_jk|, u = 2**-24,
u_out the unit roundoff of the output dtype.
"""

import jax.numpy as jnp
import numpy as np

import block_reference as ref
import helpers
import jax_fp8

U = 2.0 ** -24
U_OUT = {np.dtype(np.float32): 2.0 ** -24, np.dtype(jnp.bfloat16): 2.0 ** -8,
         np.dtype(np.float16): 2.0 ** -11}
# Half the subnormal spacing of the output type where it matters (float16's 2**-24; the
# float32/bfloat16 results here are never near their subnormal ranges).
TINY_OUT = {np.dtype(np.float16): 2.0 ** -25}
# CPU programs are compiled with LLVM at -O0: a third of the compile time, the same IEEE
# arithmetic.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def exact(qa, sa, qb, sb, ra, rb):
    """float64 E and S (see the module docstring)."""
    def deq(q, s, r):
        m, k = q.shape[-2:]
        full = np.repeat(np.repeat(s.astype(np.float64), r, -2), 128, -1)[..., :m, :k]
        return q.astype(np.float64) * full
    a, b = deq(qa, sa, ra), deq(qb, sb, rb)
    b_t = np.swapaxes(b, -1, -2)
    return a @ b_t, np.abs(a) @ np.abs(b_t)


def assert_within(out, e, s, coef, out_dtype, what):
    out = np.asarray(out, np.float64)
    u_out = U_OUT[np.dtype(out_dtype)]
    # the GEMM's error, then one rounding to out_dtype (the module docstring)
    tol = coef * (1 + u_out) * s + u_out * np.abs(e) + TINY_OUT.get(np.dtype(out_dtype), 0.0)
    err = np.abs(out - e)
    bad = err > tol
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outside the bound; worst "
                           f"err/S {np.max(err / np.maximum(s, 1e-300)):.3g} "
                           f"(bound coef {coef:.3g})")


def reference_coef(k):
    return (k + 4) * U


def cublas_coef(k):
    return 2.0 ** -10 + (k / 128 + 4) * U


def fallback_coef(k):
    return (k + k / 128 + 4) * U


def run(device, fn, *args, **kw):
    opts = FAST_COMPILE if device.platform == "cpu" else None
    return helpers.run_on(device, fn, *args, compiler_options=opts, **kw)


def block_operand(a, recipe, role, fp8):
    q, s = ref.quantize_blocks(a, recipe.block_shape(role), fp8, recipe.power_of_2_scale,
                               recipe.amax_epsilon)
    return q, s, recipe.block_shape(role)[0]


def expected(recipe, x, w, c):
    """(E, S) for out, dx, dw (module docstring; float64)."""
    fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    if isinstance(recipe, jax_fp8.Float8BlockScaling):
        def gemm(a, b):
            (qa, sa, ra), (qb, sb, rb) = a, b
            return exact(qa, sa, qb, sb, ra, rb)
        return (gemm(block_operand(x, recipe, "x", fwd), block_operand(w.T, recipe, "w", fwd)),
                gemm(block_operand(c, recipe, "grad", bwd), block_operand(w, recipe, "w", fwd)),
                gemm(block_operand(x.T, recipe, "x", fwd), block_operand(c.T, recipe, "grad", bwd)))
    opts = (recipe.power_of_2_scale, recipe.amax_epsilon)
    qx, sx = ref.quantize_current(x, fwd, *opts)
    qw, sw = ref.quantize_current(w, fwd, *opts)
    qc, sc = ref.quantize_current(c, bwd, *opts)
    def g(qa, sa, qb, sb):  # [R, C] . [P, C]^T with one scale_inv per operand
        a, b = qa.astype(np.float64), qb.astype(np.float64)
        f = np.float64(sa) * np.float64(sb)
        return (a @ b.T) * f, (np.abs(a) @ np.abs(b).T) * f
    return g(qx, sx, qw.T, sw), g(qc, sc, qw, sw), g(qx.T, sx, qc.T, sc)
