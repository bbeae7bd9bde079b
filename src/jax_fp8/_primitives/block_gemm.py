"""The block-scaled FP8 GEMM primitive `jax_fp8_block_gemm`: out = (a * scale_a) . (b * scale_b)^T,
each operand scaled per 1x128 block or 128x128 tile.

Shapes (row-major, both operands contracting over their last axis, cuBLASLt's "TN"):
a [..., M, K] and b [..., N, K] FP8, their scale_inv [..., M or ceil(M/128), ceil(K/128)]
and [..., N or ceil(N/128), ceil(K/128)] (`block_rows` 1 or 128, jax_fp8.quantize_blocks'
layout), out [..., M, N] in `out_dtype`.

With ``scale_layout="gemm"`` the scales come in cuBLASLt's layout instead
(block_quantize.gemm_scale_shape), as the quantization kernel writes them for jax_fp8's
FP8 dot: then no XLA op runs between the two custom calls.

On CUDA with an SM90 GPU and cuBLASLt >= 12.9 (dlopen'ed from JAX's nvidia-cublas wheel)
and sizes it takes (`cublas_supports`): one custom call, ffi/block_gemm_cuda.cc, which runs
the CUTLASS sm_90a kernel its measured table picks for E4M3 operands with `a` in 1x128
blocks (ffi/block_gemm_cutlass.cc; `cutlass_status`), else cuBLASLt's VEC128 / BLK128x128
matmul (or its own plain kernel, ffi/block_gemm_fallback.cu, where cuBLASLt finds no
algorithm). Scales in the spec layout are transposed and padded to
cuBLASLt's layout here, in XLA ops on arrays 128 (or 16,384) times smaller than the
operands. Everywhere else, and with ``implementation="jnp"``, the reference: each operand
dequantized in float32 (q * scale_inv broadcast over its block), a float32 dot_general
at HIGHEST precision, cast to out_dtype (a float16 output is the float32 result rounded
once: beyond 65504 it is +-inf).

Under a jit over several devices, and on meshes with Explicit axes, each device runs
this GEMM on the shards it holds (`partition.BLOCK_GEMM`).
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir

from jax_fp8 import _registration
from jax_fp8._primitives import base, partition
from jax_fp8._primitives.block_quantize import (
    BLOCK,
    SCALE_LAYOUTS,
    from_gemm_layout,
    scale_shape,
    to_gemm_layout,
)
from jax_fp8._primitives.exact import up_scaled

TARGET = "jax_fp8_block_gemm"
WORKSPACE_BYTES = 32 * 1024 * 1024  # cuBLASLt's recommendation for Hopper
MIN_CUBLASLT_VERSION = 120900
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
_KERNEL_OUT = (np.dtype(jnp.bfloat16), np.dtype(np.float32))



def _abstract_eval(a, a_scale, b, b_scale, *, a_block_rows, b_block_rows, out_dtype,
                   scale_layout):
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"jax_fp8_block_gemm: scale_layout must be one of {SCALE_LAYOUTS}")
    for name, q, rows in (("a", a, a_block_rows), ("b", b, b_block_rows)):
        if q.ndim < 2 or np.dtype(q.dtype).itemsize != 1:
            raise TypeError(f"jax_fp8_block_gemm: {name} must be an FP8 array of rank >= 2, "
                            f"got {q.dtype}{list(q.shape)}")
        if rows not in (1, BLOCK):
            raise ValueError(f"jax_fp8_block_gemm: {name}_block_rows must be 1 or 128")
    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
        raise ValueError(f"jax_fp8_block_gemm: need a [..., M, K] and b [..., N, K], got "
                         f"{list(a.shape)} and {list(b.shape)}")
    for name, s, q, rows in (("a", a_scale, a, a_block_rows), ("b", b_scale, b, b_block_rows)):
        want = scale_shape(q.shape, rows, scale_layout)
        if s.shape != want or s.dtype != np.float32:
            raise ValueError(f"jax_fp8_block_gemm: {name}_scale_inv must be float32{list(want)}, "
                             f"got {s.dtype}{list(s.shape)}")
    return a.update(shape=a.shape[:-1] + (b.shape[-2],), dtype=out_dtype, weak_type=False)


def dequantize(q, scale_inv, block_rows):
    """q [..., R, K] * scale_inv broadcast over its blocks, in float32: the IEEE product,
    also for a subnormal scale_inv (taken as two normal factors); products in the
    subnormal range read as zeros of their sign (XLA flushes them)."""
    *lead, r, k = q.shape
    lead = tuple(lead)
    rb, kb = -(-r // block_rows), -(-k // BLOCK)
    pad = [(0, 0)] * len(lead) + [(0, rb * block_rows - r), (0, kb * BLOCK - k)]
    x = jnp.pad(q.astype(jnp.float32), pad).reshape(lead + (rb, block_rows, kb, BLOCK))
    s, f = (v[..., :, None, :, None] for v in up_scaled(scale_inv))
    return ((x * s) * f).reshape(lead + (rb * block_rows, kb * BLOCK))[..., :r, :k]


def reference(a, a_scale, b, b_scale, *, a_block_rows, b_block_rows, out_dtype,
              scale_layout="spec"):
    if scale_layout == "gemm":
        a_scale = from_gemm_layout(a_scale, a_block_rows, *a.shape[-2:])
        b_scale = from_gemm_layout(b_scale, b_block_rows, *b.shape[-2:])
    x = dequantize(a, a_scale, a_block_rows)
    y = dequantize(b, b_scale, b_block_rows)
    batch = tuple(range(a.ndim - 2))
    out = lax.dot_general(x, y, (((a.ndim - 1,), (a.ndim - 1,)), (batch, batch)),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


@functools.cache
def cublas_status() -> tuple[bool, str]:
    """(whether the cuBLASLt path can run in this process, why not). Loads libcublasLt."""
    if not _registration.HAS_CUDA_KERNEL:
        return False, "the CUDA module was not built"
    path = _registration.cublaslt_path()
    if path is None:
        return False, "no libcublasLt found (set JAX_FP8_CUBLASLT to its path)"
    version, error = importlib.import_module("jax_fp8._jax_fp8_cuda").load_cublaslt(path)
    if version < MIN_CUBLASLT_VERSION:
        return False, error or f"{path} is cuBLASLt {version}, block scaling needs >= 12.9"
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        gpus = []
    caps = {getattr(d, "compute_capability", "") for d in gpus}
    if not gpus or not all(str(c).split(".")[0] == "9" for c in caps):
        return False, f"block-scaled cuBLASLt GEMMs need SM90 GPUs, found {sorted(caps)}"
    return True, f"{path} (cuBLASLt {version})"


def cutlass_configs() -> tuple[str, ...]:
    """Names of the CUTLASS configurations compiled into the CUDA module, in the order of
    the custom call's `kernel` attribute (empty without the CUDA module or CUTLASS)."""
    if not _registration.HAS_CUDA_KERNEL:
        return ()
    module = importlib.import_module("jax_fp8._jax_fp8_cuda")
    return tuple(name for name, _, _ in module.cutlass_configs())


@functools.cache
def cutlass_status() -> tuple[bool, str]:
    """(whether the CUTLASS kernels can run in this process, why not): compiled in (the
    build found the nvidia-cutlass package's headers) and SM90 GPUs present."""
    if not _registration.HAS_CUDA_KERNEL:
        return False, "the CUDA module was not built"
    names = cutlass_configs()
    if not names:
        return False, ("the CUDA module was built without CUTLASS (nvidia-cutlass's headers "
                       "were not found, or JAX_FP8_CUTLASS=OFF): block-scaled GEMMs run "
                       "through cuBLASLt")
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:
        gpus = []
    caps = {str(getattr(d, "compute_capability", "")) for d in gpus}
    if not gpus or not all(c.split(".")[0] == "9" for c in caps):
        return False, f"the CUTLASS kernels are built for sm_90a, found {sorted(caps)}"
    return True, f"{len(names)} CUTLASS sm_90a configurations: {', '.join(names)}"


def cublas_supports(a, b, a_block_rows, b_block_rows, out_dtype) -> bool:
    """Shapes and types cuBLASLt's block-scaled FP8 GEMM takes on Hopper (abstract values):
    E4M3/E5M2 (not both E5M2), at most one operand with 128 x 128 tiles, K % 16 == 0 and
    M, N % 8 == 0 (the leading dimensions' 16-byte alignment), bf16/f32/f16 output."""
    m, k = a.shape[-2:]
    n = b.shape[-2]
    types = {np.dtype(a.dtype), np.dtype(b.dtype)}
    return (types <= set(_FP8) and types != {np.dtype(jnp.float8_e5m2)}
            and not (a_block_rows == b_block_rows == BLOCK)
            and m > 0 and n > 0 and k > 0 and math.prod(a.shape[:-2]) > 0
            and k % 16 == 0 and m % 8 == 0 and n % 8 == 0
            and (np.dtype(out_dtype) in _KERNEL_OUT or np.dtype(out_dtype) == np.float16))


# The custom call's `kernel` attribute (ffi/block_gemm_cuda.cc).
_KERNEL_CODES = {"auto": 0, "cublaslt": 1, "fallback": 2}
_KERNEL_CUTLASS = 100


def _kernel_code(kernel):
    if kernel in _KERNEL_CODES:
        return _KERNEL_CODES[kernel]
    names = cutlass_configs()
    if kernel not in names:
        raise ValueError(f"jax_fp8_block_gemm: kernel must be one of {sorted(_KERNEL_CODES)} or "
                         f"a compiled CUTLASS configuration {list(names)}, got {kernel!r}")
    return _KERNEL_CUTLASS + names.index(kernel)


def _ffi_gemm(a, a_scale, b, b_scale, *, a_block_rows, b_block_rows, out_dtype, scale_layout,
              force_fallback=False, kernel="auto"):
    """The custom call. ``kernel``: "auto" (the handler's measured table: a CUTLASS
    configuration, else cuBLASLt, else its plain kernel), "cublaslt" (else the plain
    kernel), "fallback" (the plain kernel; also ``force_fallback=True``) or a name from
    `cutlass_configs()` (an error at run time where that configuration does not take the
    GEMM)."""
    code = _kernel_code("fallback" if force_fallback else kernel)
    m, n = a.shape[-2], b.shape[-2]
    # float16 out: cuBLASLt writes float32, one convert rounds it (as the reference does)
    kernel_dtype = out_dtype if np.dtype(out_dtype) in _KERNEL_OUT else np.dtype(np.float32)
    if scale_layout == "spec":
        a_scale = to_gemm_layout(a_scale, a_block_rows)
        b_scale = to_gemm_layout(b_scale, b_block_rows)
    call = jax.ffi.ffi_call(TARGET, (
        jax.ShapeDtypeStruct(a.shape[:-2] + (m, n), kernel_dtype),
        jax.ShapeDtypeStruct((256 if code == _KERNEL_CODES["fallback"] else WORKSPACE_BYTES,),
                             jnp.uint8)))
    out, _ = call(a, a_scale, b, b_scale, a_block_rows=np.int32(a_block_rows),
                  b_block_rows=np.int32(b_block_rows), kernel=np.int32(code))
    return out.astype(out_dtype)


def _kernel_lowering(ctx, *operands, **params):
    return mlir.lower_fun(functools.partial(_ffi_gemm, **params), multiple_results=False)(
        ctx, *operands)


def _kernel_supports(a, a_scale, b, b_scale, *, a_block_rows, b_block_rows, out_dtype, **_):
    del a_scale, b_scale
    return cublas_supports(a, b, a_block_rows, b_block_rows, out_dtype) and cublas_status()[0]


# Differentiated as the reference; batched in front (leading axes are independent GEMMs).
block_gemm_p = base.register(base.Spec(
    TARGET, _abstract_eval, reference, cache_reference=True, jvp="reference",
    kernels={"cuda": base.Kernel(_kernel_lowering, _kernel_supports)},
    partitioning=partition.BLOCK_GEMM, same_varying=True))


def block_gemm(a, a_scale_inv, b, b_scale_inv, *, a_block_rows, b_block_rows, out_dtype,
               implementation="auto", scale_layout="spec"):
    """Binds the primitive: a [..., M, K], b [..., N, K] (with their scale_inv) -> [..., M, N];
    `implementation` is one of base.IMPLEMENTATIONS."""
    return block_gemm_p.bind(a, a_scale_inv, b, b_scale_inv, a_block_rows=int(a_block_rows),
                             b_block_rows=int(b_block_rows), out_dtype=np.dtype(out_dtype),
                             implementation=implementation, scale_layout=scale_layout)
