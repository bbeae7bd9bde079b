"""A float32 vector split into consecutive pieces, each its own buffer: how a packed FP8
state hands each layer its scales.

``split_rows(a, sizes)`` is ``[a[0:n0], a[n0:n0+n1], ...]``. As XLA slices, a train step
on a packed state (`jax_fp8.pack_states`) gets one tiny fusion per state for the scales
cuBLASLt's FP8 GEMMs take by pointer: hundreds of kernels per step, each of which XLA:GPU
also autotunes (384 of the 446 autotuned fusions of the benchmark's d = 2048, 24-block
step), and on the CPU hundreds of users of one operand, which made XLA:CPU compile the
step about twice as long. The primitive is one custom call: on CUDA one launch
(ffi/split_cuda.cu), on the CPU copies (ffi/split_cpu.cc). Other platforms, and a
multi-device jit (whose partitioner handles slices), lower to the slices themselves; the
bits are a copy's everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp8 import _registration
from jax_fp8._primitives import common, partition

TARGET = "jax_fp8_split_rows"

split_rows_p = Primitive("jax_fp8_split_rows")
split_rows_p.multiple_results = True


def _abstract_eval(a, *, sizes):
    if a.ndim != 1 or a.dtype != np.float32 or sum(sizes) != a.shape[0] or min(sizes) < 0:
        raise TypeError(f"jax_fp8_split_rows: takes float32[R] and sizes summing to R, got "
                        f"{a.dtype}{list(a.shape)} and {sizes}")
    return [a.update(shape=(n,), weak_type=False) for n in sizes]


def _slices(a, *, sizes, axis=0):
    out, start = [], 0
    for n in sizes:
        out.append(lax.slice_in_dim(a, start, start + n, axis=axis))
        start += n
    return out


split_rows_p.def_abstract_eval(_abstract_eval)
split_rows_p.def_impl(common.eager_impl(split_rows_p))


def _kernel_lowering(ctx, a, *, sizes):
    if partition.needs_partitioning(ctx):
        return mlir.lower_fun(_slices, multiple_results=True)(ctx, a, sizes=sizes)
    return jax.ffi.ffi_lowering(TARGET)(ctx, a)


mlir.register_lowering(split_rows_p, mlir.lower_fun(_slices, multiple_results=True))
# (Where the built modules register the target: a module built from older sources keeps
# the slices.)
if TARGET in _registration.CPU_TARGETS:
    mlir.register_lowering(split_rows_p, _kernel_lowering, platform="cpu")
if TARGET in _registration.CUDA_TARGETS:
    mlir.register_lowering(split_rows_p, _kernel_lowering, platform="cuda")


def _batch(args, dims, *, sizes):
    (a,), (d,) = args, dims  # a: [B, R] or [R, B]; split the axis that is not d
    return _slices(a, sizes=sizes, axis=1 - d), [d] * len(sizes)


def _transpose(cts, a, *, sizes):
    del a
    pieces = [jnp.zeros((n,), np.float32) if type(ct) is ad.Zero else ct
              for ct, n in zip(cts, sizes)]
    return [jnp.concatenate(pieces)]


batching.primitive_batchers[split_rows_p] = _batch
# A split is linear: its tangents are split the same way, its cotangents concatenated.
ad.deflinear2(split_rows_p, _transpose)


def split_rows(a, sizes) -> list:
    """a float32 [R] -> [a[0:n0], a[n0:n0 + n1], ...] for sizes (n0, n1, ...) summing to R;
    other arrays (dtype, rank) are split with lax.slice_in_dim along axis 0."""
    sizes = tuple(int(n) for n in sizes)
    if (getattr(a, "ndim", None) != 1 or jnp.result_type(a) != np.float32
            or len(sizes) < 2 or sum(sizes) >= 2**31):
        return _slices(a, sizes=sizes)
    return split_rows_p.bind(a, sizes=sizes)
