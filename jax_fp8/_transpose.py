"""The `jax_fp8_transpose_bytes` primitive: [R, C] -> [C, R] for FP8 (1-byte) matrices.

cuBLASLt's FP8 GEMMs only contract over both operands' minor axes, so the kernel
gradient needs the quantized input and the quantized gradient transposed. XLA writes
those transposes in kernels of their own anyway (they are not fused with the
quantization), at about half the bandwidth of a copy for 1-byte elements on an H200;
on CUDA this primitive is one custom call to a byte-transpose kernel
(ffi/transpose_cuda.cu) that runs near copy speed. The bits are those of
`lax.transpose`: every other platform, a multi-device jit (whose partitioner handles
XLA's transpose), and sizes the kernel does not take lower to `lax.transpose` itself.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp8 import _amax, _partition, _registration

TRANSPOSE_TARGET = "jax_fp8_transpose_bytes"

transpose_bytes_p = Primitive("jax_fp8_transpose_bytes")


def _abstract_eval(x):
    if x.ndim != 2 or np.dtype(x.dtype).itemsize != 1:
        raise TypeError(f"jax_fp8_transpose_bytes: takes a matrix of a 1-byte type, got "
                        f"{x.dtype}{list(x.shape)}")
    return x.update(shape=(x.shape[1], x.shape[0]), weak_type=False)


transpose_bytes_p.def_abstract_eval(_abstract_eval)
transpose_bytes_p.def_impl(lambda x: _jitted_bind()(x))


@functools.lru_cache(maxsize=None)
def _jitted_bind():
    return jax.jit(transpose_bytes_p.bind)


def _swap(x):
    return lax.transpose(x, (1, 0))


def kernel_takes(rows: int, cols: int) -> bool:
    """Sizes the CUDA kernel takes (as ffi/transpose_cuda.cu's TransposeBytesSupports)."""
    return rows % 4 == 0 and cols % 4 == 0 and 0 < -(-rows // 128) <= 65535 and cols > 0


def _cuda_lowering(ctx, x):
    rows, cols = ctx.avals_in[0].shape
    if _partition.needs_partitioning(ctx) or not kernel_takes(rows, cols):
        return mlir.lower_fun(_swap, multiple_results=False)(ctx, x)
    return jax.ffi.ffi_lowering(TRANSPOSE_TARGET)(ctx, x)


mlir.register_lowering(transpose_bytes_p, mlir.lower_fun(_swap, multiple_results=False))
if _registration.HAS_CUDA_KERNEL:
    mlir.register_lowering(transpose_bytes_p, _cuda_lowering, platform="cuda")


def _batch(args, dims):
    (x,), (d,) = args, dims
    x = batching.bdim_at_front(x, d, x.shape[d])
    return lax.transpose(x, (0, 2, 1)), 0


batching.primitive_batchers[transpose_bytes_p] = _batch
# A transpose is linear: its tangent is transposed the same way, its cotangent back.
ad.deflinear2(transpose_bytes_p, lambda ct, x: [transpose_bytes_p.bind(ct)])


def rotate_axes(x, k: int):
    """x [A..., B...] -> [B..., A...] (k = number of A axes), i.e. lax.transpose(x,
    (k, ..., n-1, 0, ..., k-1)): a matrix transpose of x seen as [prod A, prod B], which
    runs as the byte-transpose kernel for FP8 arrays on CUDA."""
    n = x.ndim
    perm = tuple(range(k, n)) + tuple(range(k))
    if k in (0, n):
        return x
    if np.dtype(x.dtype).itemsize != 1 or _amax.on_explicit_mesh(x):
        # (On a mesh with Explicit axes the reshapes would need sharding rules of their own.)
        return lax.transpose(x, perm)
    lead, trail = x.shape[:k], x.shape[k:]
    y = transpose_bytes_p.bind(x.reshape(math.prod(lead), math.prod(trail)))
    return y.reshape(trail + lead)
