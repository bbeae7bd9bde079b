"""The grouped FP8 GEMM primitive (jax_fp8._primitives.grouped_gemm): its reference against a
NumPy statement of the module's four steps, bit for bit; its argument checks; the CUDA
kernel off by default (the decision explain reports); and, on a GPU with the CUDA module
built with CUTLASS, the kernel against the reference.

Bit-exact cases: FP8 values whose products and partial sums are all exact in float32
(`exact_values`), so that every summation order gives the same acc, after which both sides
do the same two float32 multiplies (alpha = lhs_scale_inv * rhs_scale_inv, then acc * alpha)
and one rounding to out_dtype. The NumPy oracle sums in float64 (exact here) and rounds to
float32.

Bound for random operands on the GPU (the same derivation as tests/kernels/
test_block_gemm.py's CUTLASS bound): with E = alpha * sum_k a_k b_k in float64 and
S = |alpha| * sum_k |a_k b_k|, each 128 values of K are summed by the FP8 tensor cores (an
error of at most 2**-10 of their |products| sum: four K=32 steps keeping about 13 bits) and
added to a float32 accumulator ((K/128 + 2) u S), then one float32 multiply by alpha (u) and
one rounding to out_dtype:
  |out - E| <= (2**-10 + (K/128 + 4) u) S (1 + u_out) + u_out |E|,   u = 2**-24.
The reference (XLA's float32 ragged_dot) is within (K + 4) u S (1 + u_out) + u_out |E|.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_fp8 import _registration
from jax_fp8._primitives import base, grouped_gemm as gg
from jax_fp8.devtools import explain

F32 = np.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TARGET = 'custom_call_target="jax_fp8_grouped_gemm"'
OUT_TYPES = (jnp.bfloat16, np.float16, np.float32)
U = 2.0 ** -24
U_OUT = {np.dtype(np.float32): U, np.dtype(jnp.bfloat16): 2.0 ** -8,
         np.dtype(np.float16): 2.0 ** -11}


# ----------------------------------------------------------------------------- the oracle

def oracle(lhs, rhs, sizes, ls, rs, out_dtype):
    """The module's steps 1-4 in NumPy: sizes clamped in order, float64 sums (exact for the
    operands used with it) rounded to float32, alpha and acc * alpha in float32 (IEEE,
    normal results), one rounding to out_dtype; rows past the groups 0."""
    m, n = lhs.shape[0], rhs.shape[1]
    a = np.asarray(lhs).astype(np.float64)
    b = np.asarray(rhs).astype(np.float64)
    out = np.zeros((m, n), np.float32)
    start = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for g, size in enumerate(np.asarray(sizes)):
            size = int(min(max(int(size), 0), m - start))
            if size:
                acc = (a[start:start + size] @ b[g].T).astype(np.float32)
                out[start:start + size] = acc * (np.float32(ls[g]) * np.float32(rs[g]))
            start += size
        return out.astype(out_dtype)


def exact_values(rng, shape, dtype):
    """FP8 values in +-[2**-2, 7.5] (and zeros): with K <= 48 every product is a multiple of
    2**-10 below 2**6 and every partial sum below 2**12, so float32 sums are exact in any
    order."""
    mag = rng.choice([0.0, 0.25, 0.375, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5,
                      4.0, 5.0, 6.0, 7.0, 7.5], size=shape)
    return (mag * rng.choice([-1.0, 1.0], size=shape)).astype(np.dtype(dtype))


def integer_values(rng, shape, dtype):
    """Integers in [-3, 3]: with K <= 48 every partial sum is an integer below 2**9, exact
    also in the FP8 tensor cores' narrower accumulator (about 13 bits below the largest
    exponent of a K=32 step), so the kernel's acc is exact too."""
    return rng.integers(-3, 4, shape).astype(np.dtype(dtype))


def scales(rng, g):
    return (2.0 ** rng.uniform(-8, 8, g)).astype(np.float32)


@functools.cache
def jitted(primitive, out_dtype, implementation="auto"):
    return jax.jit(lambda *a: primitive(*a, out_dtype=out_dtype, implementation=implementation))


def call_primitive(primitive, lhs, rhs, sizes, ls, rs, out_dtype, implementation="auto"):
    """`primitive` (grouped_gemm, or grouped_wgrad in test_grouped_wgrad.py), jitted once per
    out_dtype and implementation, on the default device (the group sizes as int32): its
    output as a NumPy array."""
    fn = jitted(primitive, np.dtype(out_dtype), implementation)
    return np.asarray(fn(lhs, rhs, np.asarray(sizes, np.int32), ls, rs))


call = functools.partial(call_primitive, gg.grouped_gemm)


SIZES = {
    "uneven": (5, 0, 17, 1, 9),          # sum 32 < M = 40: rows 32..39 are 0
    "empty_first_last": (0, 20, 20, 0, 0),
    "all_empty": (0, 0, 0, 0, 0),
    "past_m": (30, 0, 30, 7, 2),          # group 2 cut at row 40, groups 3, 4 empty
    "negative": (10, -3, 12, -(2 ** 31), 2 ** 31 - 1),
}


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("types", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)],
                         ids=["e4m3xe4m3", "e5m2xe4m3", "e4m3xe5m2"])
@pytest.mark.parametrize("out_dtype", OUT_TYPES, ids=lambda d: np.dtype(d).name)
def test_reference_matches_numpy_bit_for_bit(case, types, out_dtype):
    rng = np.random.default_rng(len(case))
    m, n, k, g = 40, 24, 48, 5
    lhs = exact_values(rng, (m, k), types[0])
    rhs = exact_values(rng, (g, n, k), types[1])
    ls, rs = scales(rng, g), scales(rng, g)
    out = call(lhs, rhs, SIZES[case], ls, rs, out_dtype)
    assert out.dtype == np.dtype(out_dtype)
    np.testing.assert_array_equal(out, oracle(lhs, rhs, SIZES[case], ls, rs, out_dtype))


def nan_inf_case(values):
    """E5M2 lhs x E4M3 rhs of `values` with NaN (E4M3's) and infinities (E5M2's): inf * 0
    and inf - inf, a NaN weight of one expert, infinite and NaN scales of one group, two rows
    past the groups."""
    rng = np.random.default_rng(7)
    m, n, k, g = 16, 8, 32, 3
    lhs = values(rng, (m, k), E5M2)
    rhs = values(rng, (g, n, k), E4M3)
    lhs[1, 3] = np.inf                       # group 0
    lhs[5, :2] = (np.inf, -np.inf)           # group 1: inf - inf
    rhs[1, 2, 4] = 0                         # and inf * 0 in column 2
    rhs[2, 5, 0] = np.nan                    # group 2: NaN weight
    sizes = (4, 4, 6)                        # rows 14, 15 past the groups
    ls = np.array([1.0, 2.0, np.inf], np.float32)
    rs = np.array([0.5, 1.0, np.nan], np.float32)
    return lhs, rhs, sizes, ls, rs


def test_reference_nan_and_inf():
    """IEEE infinities and NaNs, each in its own group's rows (a NaN weight of expert 2 does
    not reach groups 0 and 1, as it would through jax's ragged_dot alone); NaN scales only
    in their group; rows past the groups stay 0 whatever the scales."""
    lhs, rhs, sizes, ls, rs = nan_inf_case(exact_values)
    out = call(lhs, rhs, sizes, ls, rs, np.float32)
    np.testing.assert_array_equal(out, oracle(lhs, rhs, sizes, ls, rs, np.float32))
    assert np.isnan(out[8:14]).all() and (out[14:] == 0).all()
    assert np.isnan(out[5]).any() and np.isinf(out[1]).any()
    assert np.isfinite(out[[0, 2, 3]]).all() and np.isfinite(out[6:8]).all()


def test_reference_large_values_round_once():
    """acc * alpha beyond bfloat16's / float16's range: +-inf from the one rounding of the
    float32 product (the float32 value itself finite)."""
    lhs = np.full((4, 16), 448.0, np.dtype(E4M3))
    rhs = np.full((1, 8, 16), -448.0, np.dtype(E4M3))
    ls, rs = np.array([2.0 ** 60], np.float32), np.array([2.0 ** 40], np.float32)
    for out_dtype in OUT_TYPES:
        out = call(lhs, rhs, (4,), ls, rs, out_dtype)
        np.testing.assert_array_equal(out, oracle(lhs, rhs, (4,), ls, rs, out_dtype))
    assert np.isneginf(call(lhs, rhs, (4,), ls, rs, np.float16)).all()


def assert_batched_and_scale_grad(primitive, np_oracle, lhs, rhs, sizes, ls, rs):
    """Operands with a leading batch axis (sizes and scales [B, G]): jax.vmap of `primitive`
    (float32 out) equals `np_oracle` on each batch bit for bit; and the gradient of the sum
    of batch 0's output w.r.t. its lhs_scale_inv[g] equals the sum of `np_oracle`'s output
    with lhs_scale_inv = the unit vector e_g (the output is linear in each group's scale),
    to rtol 1e-6."""
    batched = jax.vmap(lambda *a: primitive(*a, out_dtype=jnp.float32))(lhs, rhs, sizes, ls, rs)
    for i in range(len(lhs)):
        np.testing.assert_array_equal(
            np.asarray(batched[i]), np_oracle(lhs[i], rhs[i], sizes[i], ls[i], rs[i], np.float32))
    grad = jax.grad(lambda s: primitive(lhs[0], rhs[0], sizes[0], s, rs[0],
                                        out_dtype=jnp.float32).sum())(ls[0])
    groups = ls.shape[1]
    for g in range(groups):
        unit = (np.arange(groups) == g).astype(np.float32)
        want = np_oracle(lhs[0], rhs[0], sizes[0], unit, rs[0], np.float32).sum(dtype=np.float64)
        np.testing.assert_allclose(float(grad[g]), want, rtol=1e-6)


def test_reference_under_vmap_and_grad():
    """Batched (vmap of the reference) and differentiated w.r.t. the scales (the reference's
    derivative): d out / d lhs_scale_inv[g] = sum of group g's rows of acc * rhs_scale_inv[g]."""
    rng = np.random.default_rng(3)
    lhs = exact_values(rng, (2, 12, 32), E4M3)
    rhs = exact_values(rng, (2, 3, 8, 32), E4M3)
    sizes = np.array([[4, 0, 8], [1, 2, 3]], np.int32)
    ls, rs = scales(rng, 6).reshape(2, 3), scales(rng, 6).reshape(2, 3)
    assert_batched_and_scale_grad(gg.grouped_gemm, oracle, lhs, rhs, sizes, ls, rs)


# ------------------------------------------------------------------------ argument checks

def _avals(m=32, n=16, k=32, g=4, lhs=E4M3, rhs=E4M3, sizes=np.int32, scale=np.float32):
    return (jax.ShapeDtypeStruct((m, k), lhs), jax.ShapeDtypeStruct((g, n, k), rhs),
            jax.ShapeDtypeStruct((g,), sizes), jax.ShapeDtypeStruct((g,), scale),
            jax.ShapeDtypeStruct((g,), scale))


@pytest.mark.parametrize("args, error, match", [
    ((jax.ShapeDtypeStruct((2, 32, 32), E4M3),) + _avals()[1:], TypeError, "lhs \\[M, K\\]"),
    ((jax.ShapeDtypeStruct((32, 32), jnp.bfloat16),) + _avals()[1:], TypeError, "FP8"),
    (_avals()[:1] + (jax.ShapeDtypeStruct((4, 16, 48), E4M3),) + _avals()[2:], ValueError,
     "share K"),
    (_avals(sizes=np.uint32), ValueError, "group_sizes must be int32\\[4\\]"),
    (_avals()[:2] + (jax.ShapeDtypeStruct((3,), np.int32),) + _avals()[3:], ValueError,
     "group_sizes must be int32\\[4\\]"),
    (_avals(scale=jnp.bfloat16), ValueError, "lhs_scale_inv must be float32\\[4\\]"),
    (_avals()[:4] + (jax.ShapeDtypeStruct((), np.float32),), ValueError,
     "rhs_scale_inv must be float32\\[4\\]"),
])
def test_argument_checks(args, error, match):
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda *a: gg.grouped_gemm(*a, out_dtype=jnp.bfloat16), *args)


def test_out_dtype_and_implementation_checks(monkeypatch):
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        jax.eval_shape(lambda *a: gg.grouped_gemm(*a, out_dtype=jnp.int32), *_avals())
    with pytest.raises(ValueError, match="implementation must be one of"):
        jax.eval_shape(lambda *a: gg.grouped_gemm(*a, out_dtype=jnp.float32,
                                                  implementation="cutlass"), *_avals())
    monkeypatch.setenv(gg.ENV, "on")
    with pytest.raises(ValueError, match="JAX_FP8_GROUPED_GEMM must be one of"):
        jax.eval_shape(lambda *a: gg.grouped_gemm(*a, out_dtype=jnp.float32), *_avals())


# ------------------------------------------------------------- the decision, on by default

def _bound_params(implementation="auto"):
    jaxpr = jax.make_jaxpr(lambda *a: gg.grouped_gemm(
        *a, out_dtype=jnp.bfloat16, implementation=implementation))(*_avals())
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is gg.grouped_gemm_p]
    return eqn.params


def _cuda_row(**kw):
    rows = explain.explain(lambda *a: gg.grouped_gemm(*a, out_dtype=jnp.bfloat16, **kw),
                           *_avals(), platform="cuda")
    (row,) = [r for r in rows if r.name == gg.TARGET]
    return row


def test_kernel_is_on_by_default_and_switched_off_by_the_environment(monkeypatch):
    """Without the variable the primitive is bound with the kernel on; explain's CUDA row
    says which lowering runs and why. JAX_FP8_GROUPED_GEMM=off binds it off, and the row
    names the switch (where this process has the CUDA handler; else that it is not built)."""
    monkeypatch.delenv(gg.ENV, raising=False)
    assert _bound_params()["kernel"] is True
    assert _bound_params("jnp")["kernel"] is False
    assert _bound_params("jnp")["implementation"] == "jnp"
    row = _cuda_row()
    assert row.why != gg.OFF_REASON
    if not gg.kernel_status()[0]:       # no SM90 GPU here: the reference, and why
        assert row.lowering == base.REFERENCE
        assert row.why in (gg.kernel_status()[1], "the cuda kernel is not built in this process")
    monkeypatch.setenv(gg.ENV, "off")
    assert _bound_params()["kernel"] is False
    assert _bound_params("cuda")["kernel"] is True       # an explicit request wins
    row = _cuda_row()
    assert row.lowering == base.REFERENCE
    if _registration.has_kernel(gg.TARGET, "cuda"):
        assert row.why == gg.OFF_REASON
        assert "JAX_FP8_GROUPED_GEMM=off" in row.why
    else:
        assert "not built" in row.why
    # the reason itself, whatever is built
    assert gg._refuses(*_avals(), out_dtype=np.dtype(jnp.bfloat16), kernel=False) == gg.OFF_REASON


@pytest.mark.parametrize("m, n, k, g, lhs, rhs, out, takes", [
    (64, 256, 128, 8, E4M3, E4M3, jnp.bfloat16, True),
    (64, 256, 128, 8, E5M2, E4M3, np.float32, True),
    (64, 256, 128, 8, E4M3, E4M3, np.float16, True),     # float32 from the kernel, converted
    (0, 256, 128, 8, E4M3, E4M3, jnp.bfloat16, True),     # nothing to write
    (64, 256, 136, 8, E4M3, E4M3, jnp.bfloat16, False),   # K % 16
    (64, 260, 128, 8, E4M3, E4M3, jnp.bfloat16, False),   # N % 8 (bf16 out)
    (64, 260, 128, 8, E4M3, E4M3, np.float32, True),      # N % 4 (f32 out)
    (64, 258, 128, 8, E4M3, E4M3, np.float32, False),
    (64, 256, 128, 8, E4M3, E5M2, jnp.bfloat16, False),   # E5M2 weights: not compiled
    (64, 256, 128, 8, E5M2, E5M2, jnp.bfloat16, False),
    (64, 256, 128, 0, E4M3, E4M3, jnp.bfloat16, False),   # no groups
])
def test_kernel_limits(m, n, k, g, lhs, rhs, out, takes):
    """ffi/grouped_gemm_limits.h, asked of the built module; where the kernel does not take
    the operands the reference runs and explain says why."""
    if not hasattr(_registration.CPU_MODULE or _registration.CUDA_MODULE,
                   "grouped_gemm_supports"):
        pytest.skip("the built module predates the grouped GEMM")
    avals = _avals(m=m, n=n, k=k, g=g, lhs=lhs, rhs=rhs)
    assert gg.kernel_supports(avals[0], avals[1], out) is takes
    reason = gg._refuses(*avals, out_dtype=np.dtype(out), kernel=True)
    if not takes and gg.kernel_status()[0]:
        assert "does not take these operands" in reason


def test_no_custom_call_lowered_for_cuda_without_an_sm90_gpu(monkeypatch):
    """Lowered for CUDA where no SM90 GPU is present (the kernel's condition): the
    reference's XLA ops, no custom call, with or without the switch."""
    if gg.kernel_status()[0]:
        pytest.skip("an SM90 GPU is present: the kernel runs "
                    "(test_gpu_env_switch_emits_the_kernel)")
    for value in (None, "off"):
        if value is None:
            monkeypatch.delenv(gg.ENV, raising=False)
        else:
            monkeypatch.setenv(gg.ENV, value)
        fn = jax.jit(lambda *a: gg.grouped_gemm(*a, out_dtype=jnp.bfloat16))
        text = fn.trace(*_avals()).lower(lowering_platforms=("cuda",)).as_text()
        assert "jax_fp8_grouped_gemm" not in text.replace("jax_fp8_grouped_gemm_", "")


def test_workspace_matches_the_handler():
    if not hasattr(_registration.CPU_MODULE or _registration.CUDA_MODULE,
                   "grouped_gemm_workspace_bytes"):
        pytest.skip("the built module predates the grouped GEMM")
    assert gg.workspace_bytes(128) == 1024 + 128 * 128 + (1 << 20)


# ----------------------------------------------------------------------------------- GPU

def exact_bound(lhs, rhs, sizes, ls, rs):
    """(E, S) in float64: E = alpha_g * lhs_rows . rhs[g]^T, S = |alpha_g| |lhs| . |rhs|^T."""
    m, n = lhs.shape[0], rhs.shape[1]
    a, b = np.asarray(lhs).astype(np.float64), np.asarray(rhs).astype(np.float64)
    e, s = np.zeros((m, n)), np.zeros((m, n))
    start = 0
    for g, size in enumerate(sizes):
        size = int(min(max(int(size), 0), m - start))
        alpha = float(np.float32(ls[g]) * np.float32(rs[g]))
        e[start:start + size] = alpha * (a[start:start + size] @ b[g].T)
        s[start:start + size] = abs(alpha) * (np.abs(a[start:start + size]) @ np.abs(b[g]).T)
        start += size
    return e, s


def assert_within(out, e, s, coef, out_dtype, what):
    """|out - E| <= coef S (1 + u_out) + u_out |E| elementwise (the module docstring's
    bound; coef a number, or an array broadcast against out)."""
    u_out = U_OUT[np.dtype(out_dtype)]
    err = np.abs(np.asarray(out, np.float64) - e)
    bound = coef * (1 + u_out) * s + u_out * np.abs(e)
    worst = np.argmax(err - bound)
    assert (err <= bound).all(), (f"{what}: |out - E| = {err.flat[worst]:.3g} > bound "
                                  f"{bound.flat[worst]:.3g}")


def kernel_coef(k):
    """The kernel's coefficient of S for a contraction of length k (a number or an array)."""
    return 2.0 ** -10 + (k / 128 + 4) * U


# The GPU helpers below take the primitive first (grouped_gemm here; test_grouped_wgrad.py
# runs them with grouped_wgrad, whose operands are alike: lhs, grad, group sizes, two
# scales) and, where they look for its custom call, the module's TARGET.

def gpu_hlo(primitive, gpu_device, *ops, out_dtype, implementation="cuda"):
    """The compiled HLO text of `primitive` on `ops`, put on gpu_device."""
    fn = jax.jit(lambda *a: primitive(*a, out_dtype=out_dtype, implementation=implementation))
    return fn.lower(*jax.device_put(ops, gpu_device)).compile().as_text()


def gpu_run(primitive, gpu_device, lhs, rhs, sizes, ls, rs, out_dtype, implementation):
    """`primitive`'s output on gpu_device (the group sizes as int32), as a NumPy array."""
    ops = (lhs, rhs, np.asarray(sizes, np.int32), ls, rs)
    fn = lambda *a: primitive(*a, out_dtype=out_dtype,  # noqa: E731
                              implementation=implementation)
    return np.asarray(helpers.run_on(gpu_device, fn, *ops))


def assert_kernel_and_reference_exact(primitive, target, gpu_device, ops, out_dtype, want):
    """On gpu_device: the program compiled with implementation="cuda" holds the custom call
    `target`, and its output and the reference's (implementation="jnp") equal `want` bit
    for bit."""
    assert f'custom_call_target="{target}"' in gpu_hlo(primitive, gpu_device, *ops,
                                                         out_dtype=out_dtype)
    out = gpu_run(primitive, gpu_device, *ops, out_dtype, "cuda")
    ref = gpu_run(primitive, gpu_device, *ops, out_dtype, "jnp")
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(ref, want)


def assert_falls_back(primitive, target, gpu_device, ops, out_dtype, want):
    """Operands the kernel does not take, on gpu_device with implementation="cuda": no
    custom call `target` in the compiled program, the output equal to `want` bit for bit,
    and explain's row of `target` says the kernel does not take these operands."""
    assert f'custom_call_target="{target}"' not in gpu_hlo(primitive, gpu_device, *ops,
                                                             out_dtype=out_dtype)
    out = gpu_run(primitive, gpu_device, *ops, out_dtype, "cuda")
    np.testing.assert_array_equal(out, want)
    (row,) = [r for r in explain.explain(
        lambda *a: primitive(*a, out_dtype=out_dtype, implementation="cuda"),
        *jax.device_put(ops, gpu_device)) if r.name == target]
    assert "does not take these operands" in row.why


_gpu_hlo = functools.partial(gpu_hlo, gg.grouped_gemm)
_gpu_run = functools.partial(gpu_run, gg.grouped_gemm)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("lhs_type", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("out_dtype", OUT_TYPES, ids=lambda d: np.dtype(d).name)
def test_gpu_kernel_matches_reference_bit_for_bit(gpu_device, case, lhs_type, out_dtype):
    """Exact sums (`integer_values`, K = 48: three 16-byte TMA rows): the kernel, the GPU
    reference and the NumPy oracle agree bit for bit: uneven, empty and clamped groups, rows
    past the groups zeroed (the output buffer is not pre-zeroed by XLA)."""
    rng = np.random.default_rng(11 + len(case))
    m, n, k, g = 40, 24, 48, 5
    lhs = integer_values(rng, (m, k), lhs_type)
    rhs = integer_values(rng, (g, n, k), E4M3)
    ls, rs = scales(rng, g), scales(rng, g)
    ops = (lhs, rhs, np.asarray(SIZES[case], np.int32), ls, rs)
    assert_kernel_and_reference_exact(gg.grouped_gemm, gg.TARGET, gpu_device, ops, out_dtype,
                                      oracle(lhs, rhs, SIZES[case], ls, rs, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, g, sizes", [
    (1000, 256, 512, 8, (100, 0, 300, 1, 127, 255, 0, 200)),     # sum 983: 17 rows past
    (4096, 768, 2048, 16, None),                                  # Qwen3-MoE-like per expert
    (333, 136, 4096, 3, (0, 333, 0)),                            # one group, K of 32 blocks
])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, np.float32], ids=["bf16", "f32"])
def test_gpu_kernel_within_bound(gpu_device, m, n, k, g, sizes, out_dtype):
    """Random E4M3 operands over their whole range and random scales: the kernel within the
    module's bound of the float64 product; rows past the groups exactly 0."""
    rng = np.random.default_rng(m + n + k)
    if sizes is None:
        cut = np.sort(rng.integers(0, m, g - 1))
        sizes = np.diff(np.concatenate([[0], cut, [m]]))
    lhs = (rng.standard_normal((m, k)) * 64).astype(np.dtype(E4M3))
    rhs = (rng.standard_normal((g, n, k)) * 64).astype(np.dtype(E4M3))
    ls, rs = scales(rng, g) * F32(2.0 ** -8), scales(rng, g) * F32(2.0 ** -8)
    out = _gpu_run(gpu_device, lhs, rhs, sizes, ls, rs, out_dtype, "cuda")
    e, s = exact_bound(lhs, rhs, sizes, ls, rs)
    assert_within(out, e, s, kernel_coef(k), out_dtype, f"{m}x{n}x{k} g={g}")
    total = min(int(np.maximum(np.asarray(sizes), 0).sum()), m)
    assert (out[total:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, out_dtype", [(24, 40, jnp.bfloat16), (20, 48, jnp.bfloat16),
                                             (18, 48, np.float32)])
def test_gpu_refused_sizes_fall_back(gpu_device, n, k, out_dtype):
    """Sizes the kernel does not take (K % 16, N % 8 for bf16, N % 4 for f32): no custom
    call, the reference's numbers, and explain says why."""
    rng = np.random.default_rng(n + k)
    lhs = exact_values(rng, (16, k), E4M3)
    rhs = exact_values(rng, (2, n, k), E4M3)
    sizes, ls, rs = (7, 5), scales(rng, 2), scales(rng, 2)
    ops = (lhs, rhs, np.asarray(sizes, np.int32), ls, rs)
    assert_falls_back(gg.grouped_gemm, gg.TARGET, gpu_device, ops, out_dtype,
                      oracle(lhs, rhs, sizes, ls, rs, out_dtype))


@pytest.mark.gpu
def test_gpu_env_switch_emits_the_kernel(gpu_device, monkeypatch):
    rng = np.random.default_rng(5)
    ops = (exact_values(rng, (32, 32), E4M3), exact_values(rng, (2, 16, 32), E4M3),
           np.array([16, 16], np.int32), scales(rng, 2), scales(rng, 2))
    monkeypatch.setenv(gg.ENV, "off")
    assert TARGET not in _gpu_hlo(gpu_device, *ops, out_dtype=jnp.bfloat16,
                                  implementation="auto")
    monkeypatch.delenv(gg.ENV, raising=False)
    assert TARGET in _gpu_hlo(gpu_device, *ops, out_dtype=jnp.bfloat16, implementation="auto")


@pytest.mark.gpu
def test_gpu_kernel_nan_and_inf(gpu_device):
    """The kernel on `nan_inf_case` (integer values elsewhere): the oracle's IEEE results,
    bit for bit (NaNs compared as NaNs)."""
    lhs, rhs, sizes, ls, rs = nan_inf_case(integer_values)
    ops = (lhs, rhs, np.asarray(sizes, np.int32), ls, rs)
    assert TARGET in _gpu_hlo(gpu_device, *ops, out_dtype=np.float32)
    out = _gpu_run(gpu_device, *ops, np.float32, "cuda")
    np.testing.assert_array_equal(out, oracle(lhs, rhs, sizes, ls, rs, np.float32))
