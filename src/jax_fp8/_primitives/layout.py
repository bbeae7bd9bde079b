"""FP8 layout changes for the GEMMs, as CUDA kernels (ffi/transpose_cuda.cu).

cuBLASLt's FP8 GEMMs only contract over both operands' minor axes, so the forward GEMM
needs the quantized kernel transposed (a Dense kernel [K, N] contracts over its leading
axis) and the kernel gradient needs the quantized input and the quantized gradient
transposed. Two primitives, each one custom call on CUDA:

* `jax_fp8_transpose_bytes`: [R, C] -> [C, R] for 1-byte (FP8) matrices; `rotate_axes`
  applies it to [A..., B...] -> [B..., A...].
* `jax_fp8_quantize_transpose`: x [R, C] (f32/bf16/f16) and a scale -> the FP8 copy of
  x, that copy transposed and max |x|, from one read of x; `quantize_rotate` is the
  [A..., B...] form that `fp8_dot_general`'s backward uses for its incoming gradient.

The bits are those of `lax.transpose`, `jax_fp8.quantize` and `compute_amax` (a NaN's
payload aside). Every other platform, a jit over several devices (whose partitioner
handles XLA's ops and the amax's one all-reduce), and sizes or types the kernels do not
take lower to those XLA ops themselves.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive

from jax_fp8 import _registration, recipe as recipe_lib
from jax_fp8._primitives import amax as amax_lib, axis_types, base

_KERNEL_IN = {np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}
_KERNEL_FP8 = {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}


def kernel_supports(rows: int, cols: int) -> bool:
    """Sizes the CUDA kernels take (ffi/transpose_cuda.cu's TransposeBytesSupports)."""
    module = _registration.CUDA_MODULE
    return module is not None and module.transpose_bytes_supports(1, int(rows), int(cols))


def _abstract_eval(x):
    if x.ndim != 2 or np.dtype(x.dtype).itemsize != 1:
        raise TypeError(f"jax_fp8_transpose_bytes: takes a matrix of a 1-byte type, got "
                        f"{x.dtype}{list(x.shape)}")
    return x.update(shape=(x.shape[1], x.shape[0]), weak_type=False)


def _swap(x):
    return lax.transpose(x, (1, 0))


# A transpose is linear: its tangent is transposed the same way, its cotangent back.
transpose_bytes_p: Primitive = base.register(base.Spec(
    "jax_fp8_transpose_bytes", _abstract_eval, _swap, batch="reference", jvp="linear",
    transpose=lambda ct, x, **params: [transpose_bytes_p.bind(ct, **params)],
    kernels={"cuda": base.Kernel(
        lambda ctx, x: jax.ffi.ffi_lowering("jax_fp8_transpose_bytes")(ctx, x),
        supports=lambda x: kernel_supports(*x.shape))}))


def rotate_axes(x, k: int):
    """x [A..., B...] -> [B..., A...] (k = number of A axes), i.e. lax.transpose(x,
    (k, ..., n-1, 0, ..., k-1)): a matrix transpose of x seen as [prod A, prod B], which
    runs as the byte-transpose kernel for FP8 arrays on CUDA."""
    n = x.ndim
    perm = tuple(range(k, n)) + tuple(range(k))
    if k in (0, n):
        return x
    if np.dtype(x.dtype).itemsize != 1 or axis_types.on_explicit_mesh(x):
        # (On a mesh with Explicit axes the reshapes would need sharding rules of their own.)
        return lax.transpose(x, perm)
    lead, trail = x.shape[:k], x.shape[k:]
    y = transpose_bytes_p.bind(x.reshape(math.prod(lead), math.prod(trail)))
    return y.reshape(trail + lead)


# --------------------------------------------------------------------------- quantize


def _qt_abstract_eval(x, scale, *, fp8_dtype):
    if x.ndim != 2 or scale.shape != () or scale.dtype != np.float32:
        raise TypeError(f"jax_fp8_quantize_transpose: takes a matrix and a float32 scalar, "
                        f"got {x.dtype}{list(x.shape)}, {scale.dtype}{list(scale.shape)}")
    rows, cols = x.shape
    return (x.update(shape=(rows, cols), dtype=fp8_dtype, weak_type=False),
            x.update(shape=(cols, rows), dtype=fp8_dtype, weak_type=False),
            x.update(shape=(), dtype=np.float32, weak_type=False))


def _qt_reference(x, scale, *, fp8_dtype):
    """What the kernel computes, in jax.numpy: jax_fp8.quantize's saturating cast,
    lax.transpose and compute_amax (so also its one-collective amax under a multi-device
    jit)."""
    fmax = np.float32(recipe_lib.fp8_max(fp8_dtype))
    q = jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(fp8_dtype)
    amax = jnp.zeros((), jnp.float32) if x.size == 0 else amax_lib.amax(x)
    return q, _swap(q), amax


def _qt_takes(x, scale, *, fp8_dtype):
    del scale
    return (kernel_supports(*x.shape) and np.dtype(x.dtype) in _KERNEL_IN
            and np.dtype(fp8_dtype) in _KERNEL_FP8)


def _qt_kernel(ctx, x, scale, *, fp8_dtype):
    return jax.ffi.ffi_lowering("jax_fp8_quantize_transpose")(
        ctx, x, scale, fp8_max=np.float32(recipe_lib.fp8_max(fp8_dtype)))


# Differentiated (e.g. the gradient of a gradient through fp8_dot_general's backward) as
# the jax.numpy ops it stands for.
quantize_transpose_p = base.register(base.Spec(
    "jax_fp8_quantize_transpose", _qt_abstract_eval, _qt_reference, multiple_results=True,
    batch="reference", jvp="reference", kernels={"cuda": base.Kernel(_qt_kernel, _qt_takes)}))


def quantize_rotate_applies(x, fp8_dtype) -> bool:
    """Whether quantize_rotate may take x: a tensor of a type the kernel reads, outside
    shard_map's per-device values and Explicit meshes (the kernel's amax is a plain
    scalar). Elsewhere callers quantize, take the amax and rotate_axes separately."""
    return (x.ndim >= 2 and np.dtype(x.dtype) in _KERNEL_IN
            and np.dtype(fp8_dtype) in _KERNEL_FP8
            and not axis_types.varying_axes(x) and not axis_types.on_explicit_mesh(x))


def quantize_rotate(x, k: int, scale, fp8_dtype):
    """(quantize(x), rotate_axes(quantize(x), k), compute_amax(x)) in one pass over x on
    CUDA (ffi/transpose_cuda.cu), the same bits as those three anywhere.

    Shapes: x [A..., B...] (k = number of A axes) -> q [A..., B...], q_t [B..., A...], []."""
    lead, trail = x.shape[:k], x.shape[k:]
    q, q_t, amax = quantize_transpose_p.bind(
        x.reshape(math.prod(lead), math.prod(trail)), jnp.asarray(scale, np.float32),
        fp8_dtype=np.dtype(fp8_dtype))
    return q.reshape(x.shape), q_t.reshape(trail + lead), amax
