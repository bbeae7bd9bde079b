"""The FP8 transpose primitives: the byte transpose (bits equal to lax.transpose) and the
quantize + transpose + amax of a gradient (bits equal to quantize, lax.transpose and
compute_amax) on every backend; the CUDA kernels in the compiled program where they
apply, XLA's ops elsewhere."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import jax_fp8
from jax_fp8 import Fp8Meta
from jax_fp8._primitives import layout
from jax_fp8.state import ScalingState

TARGET = 'custom_call_target="jax_fp8_transpose_bytes"'
QT_TARGET = 'custom_call_target="jax_fp8_quantize_transpose"'
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def random_fp8(rng, shape, dtype):
    """Every byte pattern is possible, NaNs and (for E5M2) infinities included."""
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.asarray(raw).view(np.dtype(dtype))


def as_bytes(x):
    return np.asarray(x).view(np.uint8)


# Tile edges (128 bytes), words (4 bytes), a single word, one tile, a wide and a tall case.
SHAPES = [(4, 4), (128, 128), (132, 260), (4, 1028), (1028, 8), (384, 2052), (4096, 2048)]


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", SHAPES)
def test_bits_equal_numpy(backend, device, shape, dtype):
    x = random_fp8(np.random.default_rng(sum(shape)), shape, dtype)
    got = helpers.run_on(device, layout.transpose_bytes_p.bind, x)
    assert got.dtype == np.dtype(dtype) and got.shape == shape[::-1]
    np.testing.assert_array_equal(as_bytes(got), as_bytes(x).T)


@pytest.mark.parametrize("shape", [(6, 10), (130, 4), (4, 2)])
def test_sizes_the_kernel_does_not_take_use_xla(backend, device, shape):
    """Not multiples of 4: XLA's transpose, same bits, no custom call."""
    x = random_fp8(np.random.default_rng(0), shape, jnp.float8_e4m3fn)
    got = helpers.run_on(device, layout.transpose_bytes_p.bind, x)
    np.testing.assert_array_equal(as_bytes(got), as_bytes(x).T)
    hlo = jax.jit(layout.transpose_bytes_p.bind).lower(
        jax.device_put(x, device)).compile().as_text()
    assert TARGET not in hlo


@pytest.mark.parametrize("k", [1, 2])
def test_rotate_axes_is_lax_transpose(backend, device, k):
    x = random_fp8(np.random.default_rng(k), (8, 12, 64), jnp.float8_e5m2)
    perm = tuple(range(k, 3)) + tuple(range(k))
    got = helpers.run_on(device, lambda x: layout.rotate_axes(x, k), x)
    np.testing.assert_array_equal(as_bytes(got), np.transpose(as_bytes(x), perm))


def test_rotate_axes_other_dtypes_and_trivial_k():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(layout.rotate_axes(x, 1), jnp.transpose(x, (1, 2, 0)))
    assert layout.rotate_axes(x, 0) is x and layout.rotate_axes(x, 3) is x


def test_vmap_and_eager(backend, device):
    x = random_fp8(np.random.default_rng(3), (3, 8, 16), jnp.float8_e4m3fn)
    got = helpers.run_on(device, jax.vmap(layout.transpose_bytes_p.bind), x)
    np.testing.assert_array_equal(as_bytes(got), np.transpose(as_bytes(x), (0, 2, 1)))
    eager = layout.transpose_bytes_p.bind(jax.device_put(x[0], device))
    np.testing.assert_array_equal(as_bytes(eager), as_bytes(x[0]).T)


def test_linear_rules():
    x = jnp.arange(12.0).reshape(3, 4).astype(jnp.float32)
    with pytest.raises(TypeError, match="1-byte"):
        layout.transpose_bytes_p.bind(x)
    q = x.astype(jnp.float8_e4m3fn)
    out, tangent = jax.jvp(layout.transpose_bytes_p.bind, (q,), (q,))
    np.testing.assert_array_equal(as_bytes(out), as_bytes(q).T)
    np.testing.assert_array_equal(as_bytes(tangent), as_bytes(q).T)


def test_cpu_never_has_the_custom_call():
    x = jax.device_put(jnp.zeros((128, 256), jnp.float8_e4m3fn), jax.devices("cpu")[0])
    hlo = jax.jit(layout.transpose_bytes_p.bind).lower(x).compile().as_text()
    assert TARGET not in hlo and re.search(r"\btranspose\(", hlo)


@pytest.mark.gpu
def test_gpu_program_has_the_kernel_for_fp8_dot_general_gradients(gpu_device):
    """In a compiled FP8 Dense step on the GPU every FP8 layout change is one of
    jax_fp8's kernels and none is left to XLA: cuBLASLt's FP8 GEMMs take operands
    contracted over their minor axis alone, so the forward GEMM needs the kernel [K, N]
    rotated to [N, K] (the byte transpose, `_gemms.rhs_for_forward`), the kernel gradient
    the quantized input rotated (the byte transpose, saved as the residual) and the
    gradient rotated (quantize + transpose from one read); the input gradient takes the
    kernel as stored."""
    dn = (((1,), (0,)), ((), ()))

    def loss(x, w, m):
        y, _ = jax_fp8.fp8_dot_general(x, w, dn, m)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    args = jax.device_put((jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 384)),
                           Fp8Meta.create()), gpu_device)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    # The kernel's and the input's rotations, and the gradient's quantize + transpose.
    assert hlo.count(TARGET) == 2, hlo.count(TARGET)
    assert hlo.count(QT_TARGET) == 1, hlo.count(QT_TARGET)
    assert hlo.count('custom_call_target="__cublas$lt$matmul$f8"') == 3
    f8_transposes = re.findall(r"%(?:wrapped_transpose|transpose|copy)\S* = f8e\w+\[([\d,]*)\]",
                               hlo)
    sizes = [int(np.prod([int(d) for d in shape.split(",")])) for shape in f8_transposes]
    assert sizes == [], f8_transposes


# ------------------------------------------------------------------ quantize + transpose

def special_values(rng, shape, dtype, fp8_dtype):
    """Random values spread over the FP8 range and beyond, with NaN, +-inf, +-0, values
    just past fp8_max, ones that round to FP8 subnormals, and float32 subnormals."""
    fmax = float(jnp.finfo(fp8_dtype).max)
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 6, size=shape)
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=min(flat.size, 64), replace=False)
    specials = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, fmax, -fmax, fmax * 1.01,
                -fmax * 1.5, 1e-40, -1e-42, 2.0 ** -17, 2.0 ** -10, 3e-3, 65504.0]
    for i, p in enumerate(picks):
        flat[p] = specials[i % len(specials)]
    return jnp.asarray(x, dtype)


def assert_fp8_equal(got, want):
    """Same bytes, but any NaN for a NaN (XLA and CUDA may give different NaN bits)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    g_nan = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(g_nan, np.isnan(want.astype(np.float32)))
    np.testing.assert_array_equal(as_bytes(got)[~g_nan], as_bytes(want)[~g_nan])


@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape", [(4, 4), (132, 260), (256, 128), (4096, 1024)])
def test_quantize_transpose_bits(backend, device, in_dtype, fp8_dtype, shape):
    rng = np.random.default_rng(len(shape) + shape[0])
    x = special_values(rng, shape, in_dtype, fp8_dtype)
    for scale in (np.float32(1.0), np.float32(0.37), np.float32(3e4), np.float32(1e-3)):
        got = helpers.run_on(device, lambda x, s: layout.quantize_transpose_p.bind(
            x, s, fp8_dtype=np.dtype(fp8_dtype)), x, scale)
        state = ScalingState(jnp.zeros((1,), jnp.float32), scale, scale, fp8_dtype=fp8_dtype)
        want_q = helpers.run_on(helpers.backend_device("cpu"), jax_fp8.quantize, x, state)
        assert_fp8_equal(got[0], want_q)
        assert_fp8_equal(got[1], want_q.T)
        np.testing.assert_array_equal(got[2], helpers.run_on(device, jax_fp8.compute_amax, x))


@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape", [(5, 4, 4), (3, 132, 260), (2, 256, 128)])
def test_quantize_transpose_experts_bits(backend, device, in_dtype, fp8_dtype, shape):
    """A batch of matrices (an MoE layer's expert weights [G, K, N]), each with its own
    scale: each matrix's quantize, its transpose and its amax (one NaN expert, one all
    zero), the bits of a per-expert `jax_fp8.quantize`, jnp.swapaxes and the grouped GEMM's
    `expert_amax`."""
    from jax_fp8.gemm import _grouped

    rng = np.random.default_rng(shape[1])
    w = np.array(special_values(rng, shape, np.float32, fp8_dtype))
    w[0] = np.where(np.isnan(w[0]), 1.0, w[0])       # expert 0: no NaN
    w[-1] = 0.0                                      # the last: all zeros (amax 0)
    w = jnp.asarray(w, in_dtype)
    scale = np.asarray([0.37, 3e4, 1e-3, 1.0, 2.0 ** -7][: shape[0]], np.float32)
    got = helpers.run_on(device, lambda w, s: layout.quantize_transpose_experts(
        w, s, fp8_dtype), w, scale)
    state = ScalingState(jnp.zeros((shape[0], 1), jnp.float32), scale, 1 / scale,
                         fp8_dtype=fp8_dtype)
    cpu = helpers.backend_device("cpu")
    want_q = helpers.run_on(cpu, jax_fp8.quantize, w, state)
    assert_fp8_equal(got[0], want_q)
    assert_fp8_equal(got[1], np.swapaxes(want_q, 1, 2))
    want_amax = helpers.run_on(cpu, _grouped.expert_amax, w)
    np.testing.assert_array_equal(got[2], want_amax)
    assert got[2][-1] == 0 and not np.isnan(got[2][0])


@pytest.mark.gpu
def test_gpu_quantize_transpose_experts_is_one_kernel(gpu_device):
    """On the GPU the batch is one custom call; a scale vector of the wrong length is a
    trace-time error naming the primitive."""
    w = jnp.ones((4, 128, 256), jnp.bfloat16)
    fn = jax.jit(lambda w, s: layout.quantize_transpose_experts(w, s, jnp.float8_e4m3fn))
    args = (jax.device_put(w, gpu_device), jax.device_put(jnp.ones(4, jnp.float32), gpu_device))
    assert fn.lower(*args).compile().as_text().count(QT_TARGET) == 1
    with pytest.raises(TypeError, match="jax_fp8_quantize_transpose"):
        fn.lower(args[0], jnp.ones(3, jnp.float32))


@pytest.mark.gpu
def test_quantize_transpose_amax_is_nan_with_one_nan(gpu_device):
    """As XLA's max on the GPU (its vectorized CPU max can drop a NaN instead)."""
    device = gpu_device
    x = np.ones((128, 256), np.float32)
    x[77, 201] = np.nan
    got = helpers.run_on(device, lambda x: layout.quantize_transpose_p.bind(
        x, jnp.float32(1), fp8_dtype=np.dtype(jnp.float8_e5m2)), x)
    assert np.isnan(got[2])


@pytest.mark.parametrize("k", [1, 2])
def test_quantize_rotate(backend, device, k):
    x = special_values(np.random.default_rng(k), (8, 12, 64), jnp.bfloat16, jnp.float8_e5m2)
    scale = np.float32(0.5)
    got = helpers.run_on(device, lambda x: layout.quantize_rotate(
        x, k, scale, jnp.float8_e5m2), x)
    state = ScalingState(jnp.zeros((1,), jnp.float32), scale, scale, fp8_dtype=jnp.float8_e5m2)
    want = np.asarray(jax_fp8.quantize(x, state))
    assert_fp8_equal(got[0], want)
    assert_fp8_equal(got[1], np.transpose(want, tuple(range(k, 3)) + tuple(range(k))))
    np.testing.assert_array_equal(got[2], helpers.run_on(device, jax_fp8.compute_amax, x))


def test_quantize_transpose_vmap_and_unsupported_sizes(backend, device):
    x = special_values(np.random.default_rng(5), (2, 6, 10), jnp.bfloat16, jnp.float8_e4m3fn)
    got = helpers.run_on(device, jax.vmap(lambda x: layout.quantize_transpose_p.bind(
        x, jnp.float32(2), fp8_dtype=np.dtype(jnp.float8_e4m3fn))), x)
    state = ScalingState(jnp.zeros((1,), jnp.float32), jnp.float32(2), jnp.float32(2))
    for i in range(2):
        want = np.asarray(jax_fp8.quantize(x[i], state))
        assert_fp8_equal(got[0][i], want)
        assert_fp8_equal(got[1][i], want.T)
        np.testing.assert_array_equal(got[2][i], helpers.run_on(device, jax_fp8.compute_amax, x[i]))


def test_quantize_rotate_applies():
    x = jnp.zeros((8, 16), jnp.bfloat16)
    assert layout.quantize_rotate_applies(x, jnp.float8_e5m2)
    assert not layout.quantize_rotate_applies(x, jnp.float8_e4m3fnuz)
    assert not layout.quantize_rotate_applies(x.astype(jnp.float64 if jax.config.jax_enable_x64
                                                            else jnp.int8), jnp.float8_e5m2)


@pytest.mark.gpu
def test_gpu_gradients_same_with_and_without_the_kernels(gpu_device, monkeypatch):
    """fp8_dot_general's gradients and amaxes on the GPU, with the quantize + transpose
    kernel and with XLA's quantize, amax and transpose: the amaxes (and so the FP8
    state) are bit-equal; the GEMM results agree (the two programs may pick different
    cuBLAS algorithms, so not bit for bit)."""
    dn = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 384)) * 0.05, jnp.float32)
    meta = jax.tree.map(lambda a: a * 0.5 if a.ndim == 0 else a, Fp8Meta.create())

    def grads():
        def loss(x, w, m):
            y, _ = jax_fp8.fp8_dot_general(x, w, dn, m)
            return jnp.sum(jnp.sin(y.astype(jnp.float32)))
        return helpers.run_on(gpu_device, jax.grad(loss, argnums=(0, 1, 2)), x, w, meta)

    with_kernel = grads()
    monkeypatch.setattr(layout, "quantize_rotate_applies", lambda *a: False)
    jax.clear_caches()
    without = grads()
    for a, b in zip(jax.tree.leaves(with_kernel[2]), jax.tree.leaves(without[2])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(with_kernel[:2], without[:2]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=2e-2, atol=1e-3)


def test_quantize_transpose_differentiates_as_its_jnp_ops():
    """The primitive's JVP is that of the jax.numpy ops it stands for (quantize, transpose,
    amax): the amax's tangent is the sign of the largest |x| times its tangent."""
    x = jnp.asarray(np.arange(-12.0, 12.0, dtype=np.float32).reshape(4, 6))
    t = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32))
    fn = lambda x: layout.quantize_rotate(x, 1, 1.0, jnp.float8_e4m3fn)[2]  # noqa: E731
    amax, tangent = jax.jvp(fn, (x,), (t,))
    assert float(amax) == 12.0                       # |x[0, 0]| = |-12|, the only maximum
    np.testing.assert_array_equal(tangent, -np.asarray(t)[0, 0])
