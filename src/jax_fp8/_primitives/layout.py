"""FP8 layout changes for the GEMMs, as CUDA kernels (ffi/transpose_cuda.cu).

cuBLASLt's FP8 GEMMs only contract over both operands' minor axes, so the forward GEMM
needs the quantized kernel transposed (a Dense kernel [K, N] contracts over its leading
axis) and the kernel gradient needs the quantized input and the quantized gradient
transposed. Two primitives, each one custom call on CUDA:

* `jax_fp8_transpose_bytes`: [A..., B...] -> [B..., A...] for 1-byte (FP8) arrays (``k``
  A axes; a matrix [R, C] -> [C, R]), on CUDA the array seen as the matrix [prod A,
  prod B]; `rotate_axes` binds it.
* `jax_fp8_quantize_transpose`: x [R, C] (f32/bf16/f16) and a scale -> the FP8 copy of
  x, that copy transposed and max |x|, from one read of x; `quantize_rotate` is the
  [A..., B...] form that `fp8_dot_general`'s backward uses for its incoming gradient. A
  batch x [B, R, C] takes a scale per matrix and gives an amax per matrix:
  `quantize_transpose_experts`, the expert weights of `fp8_ragged_dot` (one scale each).

The bits are those of `lax.transpose`, `jax_fp8.quantize` and `compute_amax` (a NaN's
payload aside). Every other platform, a jit over several devices (whose partitioner
handles XLA's ops and the amax's one all-reduce), meshes with Explicit axes, and sizes or
types the kernels do not take lower to those XLA ops themselves (`base.decide` says which
and why; ``jax_fp8.devtools.explain`` reports it).
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import mlir
from jax.sharding import PartitionSpec
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import _registration, recipe as recipe_lib
from jax_fp8._primitives import amax as amax_lib, axis_types, base, exact, kernel_types


def kernel_supports(rows: int, cols: int, *, batch: int = 1) -> bool:
    """Sizes the CUDA kernels take (ffi/transpose_cuda.cu's TransposeBytesSupports)."""
    module = _registration.CUDA_MODULE
    return module is not None and cast(bool, module.transpose_bytes_supports(
        int(batch), int(rows), int(cols)))


def _rotation(ndim: int, k: int) -> tuple[int, ...]:
    """The permutation taking [A..., B...] (k A axes) to [B..., A...]."""
    return tuple(range(k, ndim)) + tuple(range(k))


def _abstract_eval(x: ShapedArray, *, k: int = 1) -> ShapedArray:
    if x.ndim < 2 or not 0 < k < x.ndim or np.dtype(x.dtype).itemsize != 1:
        raise TypeError(f"jax_fp8_transpose_bytes: takes an array [A..., B...] of a 1-byte "
                        f"type with 0 < k < rank A axes (a matrix: k = 1), got "
                        f"{x.dtype}{list(x.shape)} and k = {k}")
    perm = _rotation(x.ndim, k)
    shape = tuple(x.shape[i] for i in perm)
    if axis_types.on_explicit_mesh(x):   # the sharding rotates with the axes
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        # PartitionSpec's constructor and ShapedArray.update are unannotated in JAX.
        sharding = x.sharding.update(
            spec=PartitionSpec(*(spec[i] for i in perm)))  # type: ignore[no-untyped-call]
        return cast(ShapedArray, x.update(  # type: ignore[no-untyped-call]
            shape=shape, sharding=sharding, weak_type=False))
    return cast(ShapedArray, x.update(shape=shape, weak_type=False))  # type: ignore[no-untyped-call]


def _rotate(x: jax.Array, *, k: int = 1) -> jax.Array:
    return lax.transpose(x, _rotation(x.ndim, k))


def _swap(x: jax.Array) -> jax.Array:
    return lax.transpose(x, (1, 0))


def _ffi_rotate(x: jax.Array, *, k: int) -> jax.Array:
    """The custom call on x seen as the matrix [prod A, prod B]."""
    lead, trail = x.shape[:k], x.shape[k:]
    rows, cols = math.prod(lead), math.prod(trail)
    call = jax.ffi.ffi_call(
        "jax_fp8_transpose_bytes",
        jax.ShapeDtypeStruct((cols, rows), x.dtype))  # type: ignore[no-untyped-call]
    return call(x.reshape(rows, cols)).reshape(trail + lead)


def _transpose_lowering(ctx: Any, x: Any, *, k: int = 1) -> Any:
    return mlir.lower_fun(functools.partial(_ffi_rotate, k=k), multiple_results=False)(ctx, x)


def _transpose_supports(x: ShapedArray, *, k: int = 1) -> bool:
    return kernel_supports(math.prod(x.shape[:k]), math.prod(x.shape[k:]))


def _transpose_reference_where(x: ShapedArray, *, k: int = 1) -> str | None:
    del k
    if axis_types.on_explicit_mesh(x):
        # (The kernel's matrix view would need sharding rules of its own for the reshapes.)
        return "on a mesh with Explicit axes: XLA's transpose, its sharding rotated with it"
    return None


def _transpose_transpose(ct: Any, x: Any, *, k: int = 1, **params: Any) -> list[Any]:
    del x
    return [transpose_bytes_p.bind(ct, k=ct.ndim - k, **params)]


# A transpose is linear: its tangent is rotated the same way, its cotangent back.
transpose_bytes_p = base.register(base.Spec(
    "jax_fp8_transpose_bytes", _abstract_eval, _rotate, batch="reference", jvp="linear",
    transpose=_transpose_transpose, reference_where=_transpose_reference_where,
    kernels={"cuda": base.Kernel(_transpose_lowering, supports=_transpose_supports)}))


def rotate_axes(x: jax.Array, k: int) -> jax.Array:
    """x [A..., B...] -> [B..., A...] (k = number of A axes), i.e. lax.transpose(x,
    (k, ..., n-1, 0, ..., k-1)): for a 1-byte (FP8) x the byte-transpose primitive, whose
    kernel on CUDA transposes x seen as the matrix [prod A, prod B]; other types (not the
    kernel's operands) are lax.transpose."""
    n = x.ndim
    if k in (0, n):
        return x
    if np.dtype(x.dtype).itemsize != 1:
        return lax.transpose(x, _rotation(n, k))
    return cast(jax.Array, transpose_bytes_p.bind(x, k=int(k)))


# --------------------------------------------------------------------------- quantize


def _qt_abstract_eval(x: ShapedArray, scale: ShapedArray, *, fp8_dtype: np.dtype,
                      ) -> tuple[ShapedArray, ShapedArray, ShapedArray]:
    if x.ndim not in (2, 3) or scale.shape != x.shape[:-2] or scale.dtype != np.float32:
        raise TypeError(f"jax_fp8_quantize_transpose: takes a matrix and a float32 scalar, or "
                        f"a batch of matrices [B, R, C] and float32[B], got "
                        f"{x.dtype}{list(x.shape)}, {scale.dtype}{list(scale.shape)}")
    lead, (rows, cols) = x.shape[:-2], x.shape[-2:]
    # ShapedArray.update is unannotated in JAX.
    return (x.update(shape=lead + (rows, cols), dtype=fp8_dtype, weak_type=False),  # type: ignore[no-untyped-call]
            x.update(shape=lead + (cols, rows), dtype=fp8_dtype, weak_type=False),  # type: ignore[no-untyped-call]
            x.update(shape=lead, dtype=np.float32, weak_type=False))  # type: ignore[no-untyped-call]


def _qt_reference(x: jax.Array, scale: jax.Array, *, fp8_dtype: np.dtype,
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the kernel computes, in jax.numpy: jax_fp8.quantize's saturating cast,
    lax.transpose and compute_amax (so also its one-collective amax under a multi-device
    jit); for a batch, each matrix with its own scale, and the largest magnitude bits of
    each matrix as its amax (NaN where it holds one)."""
    fmax = np.float32(recipe_lib.fp8_max(fp8_dtype))
    per_matrix = scale.astype(jnp.float32).reshape(scale.shape + (1, 1))
    q = jnp.clip(x.astype(jnp.float32) * per_matrix, -fmax, fmax).astype(fp8_dtype)
    q_t = jnp.swapaxes(q, -1, -2)
    if x.ndim == 3:
        magnitudes = exact.to_bits(exact.widen(x)) & exact.U32(0x7FFFFFFF)
        return q, q_t, exact.from_bits(jnp.max(magnitudes, axis=(1, 2),
                                               initial=exact.U32(0)))
    amax = jnp.zeros((), jnp.float32) if x.size == 0 else amax_lib.amax(x)
    return q, q_t, amax


def _qt_takes(x: ShapedArray, scale: ShapedArray, *, fp8_dtype: np.dtype) -> bool:
    del scale
    batch = x.shape[0] if x.ndim == 3 else 1
    return (kernel_supports(*x.shape[-2:], batch=batch)
            and np.dtype(x.dtype) in kernel_types.WIDE_INPUTS
            and np.dtype(fp8_dtype) in kernel_types.FP8_OUTPUTS)


def _qt_kernel(ctx: Any, x: Any, scale: Any, *, fp8_dtype: np.dtype) -> Any:
    return jax.ffi.ffi_lowering("jax_fp8_quantize_transpose")(
        ctx, x, scale, fp8_max=np.float32(recipe_lib.fp8_max(fp8_dtype)))


# Differentiated (e.g. the gradient of a gradient through fp8_dot_general's backward) as
# the jax.numpy ops it stands for.
quantize_transpose_p = base.register(base.Spec(
    "jax_fp8_quantize_transpose", _qt_abstract_eval, _qt_reference, multiple_results=True,
    batch="reference", jvp="reference", kernels={"cuda": base.Kernel(_qt_kernel, _qt_takes)}))


def quantize_rotate_applies(x: jax.Array, fp8_dtype: DTypeLike) -> bool:
    """Whether quantize_rotate may take x: a tensor of a type the kernel reads, outside
    shard_map's per-device values and Explicit meshes (the kernel's amax is a plain
    scalar). Elsewhere callers quantize, take the amax and rotate_axes separately."""
    return (x.ndim >= 2 and np.dtype(x.dtype) in kernel_types.WIDE_INPUTS
            and np.dtype(fp8_dtype) in kernel_types.FP8_OUTPUTS
            and not axis_types.varying_axes(x) and not axis_types.on_explicit_mesh(x))


def quantize_transpose_experts(w: jax.Array, scale: ArrayLike, fp8_dtype: DTypeLike,
                               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For expert weights w [G, K, N] and per-expert scales [G]: (q [G, K, N], q swapped to
    [G, N, K], each expert's amax [G]) in one pass over w on CUDA (ffi/transpose_cuda.cu),
    the bits of a per-expert `jax_fp8.quantize`, ``jnp.swapaxes(q, 1, 2)`` and the largest
    magnitude bits of each expert anywhere. Where `quantize_rotate_applies` holds."""
    q, q_t, amax = quantize_transpose_p.bind(w, jnp.asarray(scale, np.float32),
                                             fp8_dtype=np.dtype(fp8_dtype))
    return q, q_t, amax


def quantize_rotate(x: jax.Array, k: int, scale: ArrayLike, fp8_dtype: DTypeLike,
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(quantize(x), rotate_axes(quantize(x), k), compute_amax(x)) in one pass over x on
    CUDA (ffi/transpose_cuda.cu), the same bits as those three anywhere.

    Shapes: x [A..., B...] (k = number of A axes) -> q [A..., B...], q_t [B..., A...], []."""
    lead, trail = x.shape[:k], x.shape[k:]
    q, q_t, amax = quantize_transpose_p.bind(
        x.reshape(math.prod(lead), math.prod(trail)), jnp.asarray(scale, np.float32),
        fp8_dtype=np.dtype(fp8_dtype))
    return q.reshape(x.shape), q_t.reshape(trail + lead), amax
