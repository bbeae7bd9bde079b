"""jax_fp8.ragged_dot (jax.lax.ragged_dot without FP8, as one grouped kernel on a GPU) and its
primitive (jax_fp8._primitives.ragged_dot): the reference against jax.lax.ragged_dot and a
NumPy oracle, its gradients (all three products of the primitive) against jax.lax.ragged_dot's,
the argument checks, and on a GPU with the CUDA module built with CUTLASS each product's kernel
against the reference.

Bit-exact cases: bfloat16 operands that are small integers times powers of two
(`exact_operands`), so every product and every partial sum is exact in float32 and every
summation order gives the same float32 sum, after which both sides round once to the output
type. Random operands on the GPU get a bound: each side sums K products, exact in float32, in
float32 (an error of at most (K - 1) u sum_k |a_k b_k| each, u = 2**-24), then rounds once, so
  |out_kernel - out_ref| <= 2 (K - 1) u S + u_out (|out_kernel| + |out_ref|),
S = sum_k |a_k b_k| in float64, u_out the output type's unit roundoff.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_fp8
from jax_fp8._primitives import ragged_dot as rd
from jax_fp8.devtools.explain import explain

BF16 = jnp.bfloat16
TARGET = 'custom_call_target="jax_fp8_ragged_dot"'
U = 2.0 ** -24
U_OUT = {np.dtype(np.float32): U, np.dtype(BF16): 2.0 ** -8, np.dtype(np.float16): 2.0 ** -11}

# (M, K, N, sizes): uneven, empty, negative, past M, and more groups than one scan chunk (256).
CASES = {
    "uneven": (96, 32, 40, [10, 0, 30, 20, 36]),
    "empty_first_last": (64, 16, 8, [0, 33, 31, 0]),
    "clamped": (48, 24, 16, [-3, 20, 40, 7]),
    "rows_past_groups": (80, 8, 24, [5, 17, 3]),
    "many_groups": (600, 16, 16, [1, 0, 3, 2] * 75),
    "one_group": (128, 64, 64, [128]),
}


def exact_operands(rng, m, k, n, g, mode):
    """bfloat16 lhs and rhs of `mode`'s shapes with values i * 2**e, |i| <= 7, e in [-2, 2]:
    products and partial sums stay exact in float32 for these sizes."""
    def draw(shape):
        return (rng.integers(-7, 8, shape) * 2.0 ** rng.integers(-2, 3, shape)).astype(BF16)
    rhs_shape = {rd.FORWARD: (g, k, n), rd.TRANSPOSED: (g, n, k), rd.WEIGHT_GRAD: (m, n)}[mode]
    return draw((m, k)), draw(rhs_shape)


def oracle(lhs, rhs, sizes, mode, out_dtype):
    """The products in NumPy: sizes clamped in order, float64 sums (exact here) rounded to
    float32 then to out_dtype; rows past the groups and empty groups' products 0."""
    a, b = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    m, k = a.shape
    g = len(sizes)
    out = (np.zeros((g, k, b.shape[1])) if mode == rd.WEIGHT_GRAD else
           np.zeros((m, b.shape[2] if mode == rd.FORWARD else b.shape[1])))
    start = 0
    for i, size in enumerate(sizes):
        size = int(min(max(int(size), 0), m - start))
        rows = slice(start, start + size)
        if mode == rd.FORWARD:
            out[rows] = a[rows] @ b[i]
        elif mode == rd.TRANSPOSED:
            out[rows] = a[rows] @ b[i].T
        else:
            out[i] = a[rows].T @ b[rows]
        start += size
    return out.astype(np.float32).astype(out_dtype)


# ---------------------------------------------------------------------- the reference (CPU)

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", rd.MODES, ids=["forward", "transposed", "wgrad"])
@pytest.mark.parametrize("out_dtype", [BF16, np.float32], ids=["bf16", "f32"])
def test_reference_matches_oracle_bit_for_bit(case, mode, out_dtype):
    m, k, n, sizes = CASES[case]
    lhs, rhs = exact_operands(np.random.default_rng(len(sizes) + mode), m, k, n, len(sizes), mode)
    got = rd.ragged_product(lhs, rhs, jnp.asarray(sizes, jnp.int32), mode=mode,
                            out_dtype=out_dtype, implementation="jnp")
    np.testing.assert_array_equal(np.asarray(got), oracle(lhs, rhs, sizes, mode, out_dtype))


def test_public_function_is_lax_ragged_dot():
    """Values, dtype and both gradients of jax.lax.ragged_dot (bf16 operands, exact values:
    the same bits), and rows past the groups 0."""
    m, k, n, sizes = CASES["uneven"]
    lhs, rhs = exact_operands(np.random.default_rng(1), m, k, n, len(sizes), rd.FORWARD)
    gs = jnp.asarray(sizes, jnp.int32)
    out = jax_fp8.ragged_dot(lhs, rhs, gs)
    want = jax.lax.ragged_dot(lhs, rhs, gs)
    assert out.dtype == want.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))

    def loss(f, x, w):
        return jnp.sum(f(x, w, gs).astype(jnp.float32) * jnp.arange(n, dtype=jnp.float32))

    got = jax.grad(functools.partial(loss, jax_fp8.ragged_dot), (0, 1))(lhs, rhs)
    ref = jax.grad(functools.partial(loss, jax.lax.ragged_dot), (0, 1))(lhs, rhs)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_preferred_element_type_and_forward_mode():
    m, k, n, sizes = CASES["clamped"]
    lhs, rhs = exact_operands(np.random.default_rng(2), m, k, n, len(sizes), rd.FORWARD)
    gs = jnp.asarray(sizes, jnp.int32)
    out = jax_fp8.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out), oracle(lhs, rhs, sizes, rd.FORWARD,
                                                          np.float32))
    # jax.jvp: the tangent is the product of each tangent with the other primal.
    _, tangent = jax.jvp(lambda x, w: jax_fp8.ragged_dot(x, w, gs, preferred_element_type=
                                                         jnp.float32), (lhs, rhs), (lhs, rhs))
    np.testing.assert_array_equal(np.asarray(tangent), 2 * np.asarray(out))


def test_second_order_gradients_match_lax():
    """grad of grad goes through the transposes of the transposes (all three products);
    jax.lax.ragged_dot has no second derivative, so the reference is each group's dense
    product, masked."""
    m, k, n, sizes = CASES["uneven"]
    lhs, rhs = exact_operands(np.random.default_rng(3), m, k, n, len(sizes), rd.FORWARD)
    lhs, rhs = lhs.astype(np.float32), rhs.astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)

    group = np.repeat(np.arange(len(sizes)), sizes)

    def dense(x, w, _):
        return sum(jnp.where((group == i)[:, None], x @ w[i], 0.0) for i in range(len(sizes)))

    def inner(f, x, w):
        return jnp.sum(f(x, w, gs) ** 2)

    def outer(f, x, w):
        return jnp.sum(jax.grad(functools.partial(inner, f), 1)(x, w) ** 2)

    got = jax.grad(functools.partial(outer, jax_fp8.ragged_dot), (0, 1))(lhs, rhs)
    ref = jax.grad(functools.partial(outer, dense), (0, 1))(lhs, rhs)
    for a, b in zip(got, ref):   # float32 sums of fourth powers, in other orders
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_non_finite_weight_stays_in_its_group():
    """An expert's NaN weight reaches only its group's rows (jax's expansion of ragged_dot
    would spread 0 * NaN to every row)."""
    m, k, n, sizes = CASES["uneven"]
    lhs, rhs = exact_operands(np.random.default_rng(4), m, k, n, len(sizes), rd.FORWARD)
    rhs[2, 0, 0] = np.nan
    out = np.asarray(jax_fp8.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32)), np.float32)
    nan_rows = np.flatnonzero(np.isnan(out).any(axis=1))
    np.testing.assert_array_equal(nan_rows, np.arange(10, 40))


def test_argument_checks():
    x = jnp.zeros((8, 16), BF16)
    with pytest.raises(ValueError, match="need lhs"):
        jax_fp8.ragged_dot(x, jnp.zeros((2, 8, 8), BF16), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        jax_fp8.ragged_dot(x, jnp.zeros((2, 16, 8), BF16), jnp.zeros((3,), jnp.int32))
    with pytest.raises(NotImplementedError, match="group_offset"):
        jax_fp8.ragged_dot(x, jnp.zeros((2, 16, 8), BF16), jnp.zeros((2,), jnp.int32),
                           group_offset=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="mode"):
        rd.ragged_product(x, jnp.zeros((2, 16, 8), BF16), jnp.zeros((2,), jnp.int32), mode=3,
                          out_dtype=BF16)


def test_integer_operands_go_to_lax():
    """Operands the primitive does not take run as jax.lax.ragged_dot itself."""
    x = jnp.ones((8, 4), jnp.int32)
    w = jnp.ones((2, 4, 3), jnp.int32)
    out = jax_fp8.ragged_dot(x, w, jnp.array([3, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.full((8, 3), 4))


def test_cuda_lowering_is_one_kernel_per_product():
    """Lowered for CUDA (no GPU needed), a training step's forward, input gradient and weight
    gradient are three custom calls of the kernel where it is built, and XLA's ragged_dot
    nowhere; without the kernel, explain names why the reference runs."""
    m, k, n, g = 256, 64, 128, 4
    lhs = jax.ShapeDtypeStruct((m, k), BF16)
    rhs = jax.ShapeDtypeStruct((g, k, n), BF16)
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)

    def step(x, w, s):
        return jax.grad(lambda x, w: jnp.sum(jax_fp8.ragged_dot(x, w, s).astype(jnp.float32)),
                        (0, 1))(x, w)

    text = jax.jit(step).trace(lhs, rhs, gs).lower(lowering_platforms=("cuda",)).as_text()
    ok, why = rd.kernel_status()
    rows = [r for r in explain(jax.jit(step), lhs, rhs, gs, platform="cuda")
            if r.name == rd.TARGET]
    assert len(rows) == 3, rows
    if ok:   # built with CUTLASS, on an SM90 GPU
        assert text.count("stablehlo.custom_call @jax_fp8_ragged_dot(") == 3, text
        assert "ragged_dot_general" not in text and "ragged_dot\"" not in text
        assert {r.lowering for r in rows} == {"kernel"}, rows
    else:    # the reference, and why
        assert "jax_fp8_ragged_dot(" not in text
        assert {r.lowering for r in rows} == {"reference"}, rows
        assert {r.why for r in rows} <= {why, "the cuda kernel is not built in this process"}


# ------------------------------------------------------------------------------ the kernel

def _run(gpu_device, lhs, rhs, sizes, mode, out_dtype, implementation):
    fn = functools.partial(rd.ragged_product, mode=mode, out_dtype=out_dtype,
                           implementation=implementation)
    return np.asarray(helpers.run_on(gpu_device, fn, lhs, rhs, jnp.asarray(sizes, jnp.int32)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", rd.MODES, ids=["forward", "transposed", "wgrad"])
def test_gpu_kernel_matches_reference_bit_for_bit(gpu_device, case, mode):
    m, k, n, sizes = CASES[case]
    lhs, rhs = exact_operands(np.random.default_rng(7 + mode), m, k, n, len(sizes), mode)
    out_types = [BF16, np.float32] if mode == rd.WEIGHT_GRAD else [BF16]
    for out_dtype in out_types:
        fn = functools.partial(rd.ragged_product, mode=mode, out_dtype=out_dtype)
        ops = jax.device_put((lhs, rhs, jnp.asarray(sizes, jnp.int32)), gpu_device)
        assert TARGET in jax.jit(fn).lower(*ops).compile().as_text()
        got = _run(gpu_device, lhs, rhs, sizes, mode, out_dtype, "auto")
        np.testing.assert_array_equal(got, oracle(lhs, rhs, sizes, mode, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", rd.MODES, ids=["forward", "transposed", "wgrad"])
def test_gpu_kernel_within_bound(gpu_device, mode):
    m, k, n = 4096, 1024, 512
    sizes = np.array([700, 0, 1, 1500, 17, 1000, 878], np.int64)
    rng = np.random.default_rng(11)
    rhs_shape = {rd.FORWARD: (7, k, n), rd.TRANSPOSED: (7, n, k), rd.WEIGHT_GRAD: (m, n)}[mode]
    lhs = rng.standard_normal((m, k)).astype(BF16)
    rhs = rng.standard_normal(rhs_shape).astype(BF16)
    got = _run(gpu_device, lhs, rhs, sizes, mode, BF16, "auto").astype(np.float64)
    ref = _run(gpu_device, lhs, rhs, sizes, mode, BF16, "jnp").astype(np.float64)
    a, b = np.abs(np.asarray(lhs, np.float64)), np.abs(np.asarray(rhs, np.float64))
    s = oracle(a, b, sizes, mode, np.float64)
    terms = k if mode != rd.WEIGHT_GRAD else m
    bound = 2 * (terms - 1) * U * s + U_OUT[np.dtype(BF16)] * (np.abs(got) + np.abs(ref))
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


@pytest.mark.gpu
def test_gpu_training_step_matches_lax(gpu_device):
    """A mixture-of-experts step's gradients on the GPU: the kernels' against jax's ragged_dot
    (exact operands: the same bits), the three products custom calls in the compiled HLO."""
    m, k, n, sizes = CASES["uneven"]
    lhs, rhs = exact_operands(np.random.default_rng(12), m, k, n, len(sizes), rd.FORWARD)
    gs = jnp.asarray(sizes, jnp.int32)

    def step(f, x, w):
        return jax.grad(lambda x, w: jnp.sum(f(x, w, gs).astype(jnp.float32) ** 2), (0, 1))(x, w)

    ops = jax.device_put((lhs, rhs), gpu_device)
    hlo = jax.jit(functools.partial(step, jax_fp8.ragged_dot)).lower(*ops).compile().as_text()
    assert hlo.count(TARGET) == 3, hlo
    got = jax.jit(functools.partial(step, jax_fp8.ragged_dot))(*ops)
    ref = jax.jit(functools.partial(step, jax.lax.ragged_dot))(*ops)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
