"""The FP8 byte-transpose primitive: bits equal to lax.transpose on every backend, the
CUDA kernel in the compiled program where it applies, XLA's transpose elsewhere."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from jax_fp8 import _transpose, ops
from jax_fp8.ops import Fp8Meta

TARGET = 'custom_call_target="jax_fp8_transpose_bytes"'
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
    got = helpers.run_on(device, _transpose.transpose_bytes_p.bind, x)
    assert got.dtype == np.dtype(dtype) and got.shape == shape[::-1]
    np.testing.assert_array_equal(as_bytes(got), as_bytes(x).T)


@pytest.mark.parametrize("shape", [(6, 10), (130, 4), (4, 2)])
def test_sizes_the_kernel_does_not_take_use_xla(backend, device, shape):
    """Not multiples of 4: XLA's transpose, same bits, no custom call."""
    x = random_fp8(np.random.default_rng(0), shape, jnp.float8_e4m3fn)
    got = helpers.run_on(device, _transpose.transpose_bytes_p.bind, x)
    np.testing.assert_array_equal(as_bytes(got), as_bytes(x).T)
    hlo = jax.jit(_transpose.transpose_bytes_p.bind).lower(
        jax.device_put(x, device)).compile().as_text()
    assert TARGET not in hlo


@pytest.mark.parametrize("k", [1, 2])
def test_rotate_axes_is_lax_transpose(backend, device, k):
    x = random_fp8(np.random.default_rng(k), (8, 12, 64), jnp.float8_e5m2)
    perm = tuple(range(k, 3)) + tuple(range(k))
    got = helpers.run_on(device, lambda x: _transpose.rotate_axes(x, k), x)
    np.testing.assert_array_equal(as_bytes(got), np.transpose(as_bytes(x), perm))


def test_rotate_axes_other_dtypes_and_trivial_k():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(_transpose.rotate_axes(x, 1), jnp.transpose(x, (1, 2, 0)))
    assert _transpose.rotate_axes(x, 0) is x and _transpose.rotate_axes(x, 3) is x


def test_vmap_and_eager(backend, device):
    x = random_fp8(np.random.default_rng(3), (3, 8, 16), jnp.float8_e4m3fn)
    got = helpers.run_on(device, jax.vmap(_transpose.transpose_bytes_p.bind), x)
    np.testing.assert_array_equal(as_bytes(got), np.transpose(as_bytes(x), (0, 2, 1)))
    eager = _transpose.transpose_bytes_p.bind(jax.device_put(x[0], device))
    np.testing.assert_array_equal(as_bytes(eager), as_bytes(x[0]).T)


def test_linear_rules():
    x = jnp.arange(12.0).reshape(3, 4).astype(jnp.float32)
    with pytest.raises(TypeError, match="1-byte"):
        _transpose.transpose_bytes_p.bind(x)
    q = x.astype(jnp.float8_e4m3fn)
    out, tangent = jax.jvp(_transpose.transpose_bytes_p.bind, (q,), (q,))
    np.testing.assert_array_equal(as_bytes(out), as_bytes(q).T)
    np.testing.assert_array_equal(as_bytes(tangent), as_bytes(q).T)


def test_cpu_never_has_the_custom_call():
    x = jax.device_put(jnp.zeros((128, 256), jnp.float8_e4m3fn), jax.devices("cpu")[0])
    hlo = jax.jit(_transpose.transpose_bytes_p.bind).lower(x).compile().as_text()
    assert TARGET not in hlo and re.search(r"\btranspose\(", hlo)


@pytest.mark.gpu
def test_gpu_program_has_the_kernel_for_fp8_dot_general_gradients(gpu_device):
    """In a compiled FP8 Dense step on the GPU, the two transposes of the kernel
    gradient (quantized input, quantized gradient) are the byte-transpose kernel and no
    FP8 transpose is left to XLA."""
    dn = (((1,), (0,)), ((), ()))

    def loss(x, w, m):
        y, _ = ops.fp8_dot_general(x, w, dn, m)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    args = jax.device_put((jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 384)),
                           Fp8Meta.create()), gpu_device)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    assert hlo.count(TARGET) == 2, hlo.count(TARGET)
    # (The kernel's own cast + transpose from float32 stays one XLA fusion.)
    f8_transposes = [ln for ln in hlo.splitlines()
                     if re.search(r"%(wrapped_transpose|transpose|copy)\S* = f8e", ln)]
    assert not f8_transposes, f8_transposes
