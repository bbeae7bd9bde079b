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
and sizes it takes (`cublas_supports`: ffi/block_gemm_limits.h): one custom call,
ffi/block_gemm_cuda.cc, which runs the CUTLASS sm_90a kernel its measured table picks for
E4M3 operands with `a` in 1x128 blocks (ffi/block_gemm_cutlass.cc; `cutlass_status`), else
cuBLASLt's VEC128 / BLK128x128 matmul (or its own plain kernel,
ffi/block_gemm_fallback.cu, where cuBLASLt finds no algorithm). Scales in the spec layout
are transposed and padded to cuBLASLt's layout here, in XLA ops on arrays 128 (or 16,384)
times smaller than the operands. Everywhere else, and with ``implementation="jnp"``, the
reference: each operand dequantized in float32 (q * scale_inv broadcast over its block), a
float32 dot_general at HIGHEST precision, cast to out_dtype (a float16 output is the
float32 result rounded once: beyond 65504 it is +-inf).

Under a jit over several devices, and on meshes with Explicit axes, each device runs
this GEMM on the shards it holds (`PARTITIONING`): its batch and M axes as a's, N as b's,
K sharded only where both operands' shards hold whole 128-blocks along it (then each
device's float32 product is summed over the K shards); everything else is gathered, as
FP8 with its scales (1 byte a value, plus one float32 per block), before the GEMM.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jax_fp8 import _registration
from jax_fp8._primitives import base, kernel_types, partition_specs as specs
from jax_fp8._primitives.block_quantize import (
    BLOCK,
    SCALE_LAYOUTS,
    from_gemm_layout,
    pad_scales,
    scale_shape,
    shards_fit,
    to_gemm_layout,
)
from jax_fp8._primitives.exact import up_scaled

TARGET = "jax_fp8_block_gemm"
WORKSPACE_BYTES = 32 * 1024 * 1024  # cuBLASLt's recommendation for Hopper
MIN_CUBLASLT_VERSION = 120900



def _abstract_eval(a: ShapedArray, a_scale: ShapedArray, b: ShapedArray, b_scale: ShapedArray, *,
                   a_block_rows: int, b_block_rows: int, out_dtype: np.dtype,
                   scale_layout: str) -> ShapedArray:
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
    # ShapedArray.update is unannotated in JAX.
    return cast(ShapedArray, a.update(  # type: ignore[no-untyped-call]
        shape=a.shape[:-1] + (b.shape[-2],), dtype=out_dtype, weak_type=False))


def dequantize(q: Any, scale_inv: jax.Array, block_rows: int) -> jax.Array:
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


def reference(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, *,
              a_block_rows: int, b_block_rows: int, out_dtype: DTypeLike,
              scale_layout: str = "spec") -> jax.Array:
    if scale_layout == "gemm":
        a_scale = from_gemm_layout(a_scale, a_block_rows, *a.shape[-2:])
        b_scale = from_gemm_layout(b_scale, b_block_rows, *b.shape[-2:])
    x = dequantize(a, a_scale, a_block_rows)
    y = dequantize(b, b_scale, b_block_rows)
    batch = tuple(range(a.ndim - 2))
    out = lax.dot_general(x, y, (((a.ndim - 1,), (a.ndim - 1,)), (batch, batch)),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _sm90(what: str) -> tuple[bool, str]:
    """(whether every local GPU is SM90, why not): the condition of `what`, from the one
    probe of the local GPUs (`_registration.local_gpu_capabilities`)."""
    sm90, caps = _registration.local_gpus_are_sm90()
    return sm90, "" if sm90 else f"{what} need SM90 GPUs, found {caps}"


@functools.cache
def cublas_status() -> tuple[bool, str]:
    """(whether the cuBLASLt path can run in this process, why not). Loads libcublasLt
    (once: the cuBLASLt version and the GPUs are probed once per process)."""
    if not _registration.HAS_CUDA_KERNEL:
        return False, "the CUDA module was not built"
    path = _registration.cublaslt_path()
    if path is None:
        return False, "no libcublasLt found (set JAX_FP8_CUBLASLT to its path)"
    version, error = importlib.import_module("jax_fp8._jax_fp8_cuda").load_cublaslt(path)
    if version < MIN_CUBLASLT_VERSION:
        return False, error or f"{path} is cuBLASLt {version}, block scaling needs >= 12.9"
    sm90, why = _sm90("block-scaled cuBLASLt GEMMs")
    if not sm90:
        return False, why
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
    sm90, why = _sm90("the CUTLASS kernels, built for sm_90a,")
    if not sm90:
        return False, why
    return True, f"{len(names)} CUTLASS sm_90a configurations: {', '.join(names)}"


def cublas_supports(a: Any, b: Any, a_block_rows: int, b_block_rows: int,
                    out_dtype: DTypeLike) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM takes a [..., M, K] . b [..., N, K] (abstract
    values, or anything with shape and dtype) into `out_dtype` (a float16 result is the
    custom call's float32, converted). The limits are ffi/block_gemm_limits.h's
    BlockGemmSupports, asked of the built module (the CUDA module, else the CPU module:
    both carry them); False where neither is built."""
    module = _registration.CUDA_MODULE or _registration.CPU_MODULE
    batch = math.prod(a.shape[:-2])
    if module is None or not 0 <= batch < 2 ** 63:
        return False
    m, k = a.shape[-2:]
    return cast(bool, module.block_gemm_supports(
        np.dtype(a.dtype).name, np.dtype(b.dtype).name, kernel_types.gemm_output(out_dtype).name,
        a_block_rows == BLOCK, b_block_rows == BLOCK, int(batch), int(m), int(b.shape[-2]),
        int(k)))


# The custom call's `kernel` attribute (ffi/block_gemm_cuda.cc).
_KERNEL_CODES = {"auto": 0, "cublaslt": 1, "fallback": 2}
_KERNEL_CUTLASS = 100


def _kernel_code(kernel: str) -> int:
    if kernel in _KERNEL_CODES:
        return _KERNEL_CODES[kernel]
    names = cutlass_configs()
    if kernel not in names:
        raise ValueError(f"jax_fp8_block_gemm: kernel must be one of {sorted(_KERNEL_CODES)} or "
                         f"a compiled CUTLASS configuration {list(names)}, got {kernel!r}")
    return _KERNEL_CUTLASS + names.index(kernel)


def _ffi_gemm(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array, *,
              a_block_rows: int, b_block_rows: int, out_dtype: DTypeLike, scale_layout: str,
              force_fallback: bool = False, kernel: str = "auto") -> jax.Array:
    """The custom call. ``kernel``: "auto" (the handler's measured table: a CUTLASS
    configuration, else cuBLASLt, else its plain kernel), "cublaslt" (else the plain
    kernel), "fallback" (the plain kernel; also ``force_fallback=True``) or a name from
    `cutlass_configs()` (an error at run time where that configuration does not take the
    GEMM)."""
    code = _kernel_code("fallback" if force_fallback else kernel)
    m, n = a.shape[-2], b.shape[-2]
    kernel_dtype = kernel_types.gemm_output(out_dtype)
    if scale_layout == "spec":
        a_scale = to_gemm_layout(a_scale, a_block_rows)
        b_scale = to_gemm_layout(b_scale, b_block_rows)
    # jax.ShapeDtypeStruct's constructor is unannotated in JAX.
    call = jax.ffi.ffi_call(TARGET, (
        jax.ShapeDtypeStruct(a.shape[:-2] + (m, n), kernel_dtype),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((256 if code == _KERNEL_CODES["fallback"] else WORKSPACE_BYTES,),
                             jnp.uint8)))  # type: ignore[no-untyped-call]
    out, _ = call(a, a_scale, b, b_scale, a_block_rows=np.int32(a_block_rows),
                  b_block_rows=np.int32(b_block_rows), kernel=np.int32(code))
    return out.astype(out_dtype)


def _kernel_lowering(ctx: Any, *operands: Any, **params: Any) -> Any:
    return mlir.lower_fun(functools.partial(_ffi_gemm, **params), multiple_results=False)(
        ctx, *operands)


def _kernel_supports(a: ShapedArray, a_scale: ShapedArray, b: ShapedArray, b_scale: ShapedArray, *,
                     a_block_rows: int, b_block_rows: int, out_dtype: np.dtype,
                     **_: Any) -> bool:
    del a_scale, b_scale
    return cublas_supports(a, b, a_block_rows, b_block_rows, out_dtype)


def _kernel_refuses(*avals: Any, **params: Any) -> str | None:
    """Why the custom call cannot run in this process (`cublas_status`), else None."""
    del avals, params
    ok, why = cublas_status()
    return None if ok else why


# ----------------------------------------------------------------------- partitioning

def _gemm_specs(params: dict[str, Any], mesh: jax.sharding.Mesh, a_shape: Sequence[int],
                a_spec: Sequence[Any], b_shape: Sequence[int], b_spec: Sequence[Any],
                ) -> tuple[tuple[Any, ...], Any, Any, Any]:
    """(lead, m, n, k) PartitionSpec entries for the GEMM a [..., M, K] . b [..., N, K]:
    a's batch and M axes, b's N axis, and K as a's (else b's), each kept where its shards
    hold whole blocks (and the GEMM layout's scales need no padding) and its mesh axes
    are not taken by an earlier one."""
    ra, rb, gemm = params["a_block_rows"], params["b_block_rows"], params["scale_layout"] == "gemm"
    *lead_shape, m, k = a_shape
    n = b_shape[-2]
    kb = -(-k // BLOCK)
    used: set[str] = set()

    def take(entry: Any, size: int, whole: bool, padded: int | None) -> Any:
        axes = specs.spec_axes(entry)
        if not axes or used & set(axes):
            return None
        if not shards_fit(size, specs.axes_size(mesh, axes), whole,
                          () if padded is None else (padded,)):
            return None
        used.update(axes)
        return entry

    lead = tuple(take(e, d, False, None) for e, d in zip(a_spec[:-2], lead_shape))
    m_entry = take(a_spec[-2], m, ra == BLOCK, m if gemm and ra == 1 else None)
    n_entry = take(b_spec[-2], n, rb == BLOCK, n if gemm and rb == 1 else None)
    k_padded = kb if gemm and BLOCK in (ra, rb) else None
    k_entry = take(a_spec[-1], k, True, k_padded) or take(b_spec[-1], k, True, k_padded)
    return lead, m_entry, n_entry, k_entry


def _scale_spec(lead: tuple[Any, ...], rows_entry: Any, k_entry: Any, block_rows: int,
                gemm: bool) -> tuple[Any, ...]:
    # GEMM layout: 1x128 scales [..., kb, R], 128x128 [..., rb, kb]; spec layout [..., R, kb]
    return lead + ((k_entry, rows_entry) if gemm and block_rows == 1 else (rows_entry, k_entry))


def _gemm_shardings(params: dict[str, Any], mesh: jax.sharding.Mesh, arg_shapes: Sequence[Any],
                    ) -> tuple[tuple[NamedSharding, ...], NamedSharding]:
    a, _, b, _ = arg_shapes
    lead, m, n, k = _gemm_specs(params, mesh, a.shape, specs.padded_spec(a.sharding, a.ndim),
                                b.shape, specs.padded_spec(b.sharding, b.ndim))
    gemm = params["scale_layout"] == "gemm"
    operand_specs = (lead + (m, k), _scale_spec(lead, m, k, params["a_block_rows"], gemm),
                     lead + (n, k), _scale_spec(lead, n, k, params["b_block_rows"], gemm))
    # PartitionSpec's constructor is unannotated in JAX.
    named: Callable[[Any], NamedSharding] = \
        lambda spec: NamedSharding(mesh, PartitionSpec(*spec))  # type: ignore[no-untyped-call]  # noqa: E731
    return tuple(named(s) for s in operand_specs), named(lead + (m, n))


def _gemm_local(bind: Callable[..., Any], operands: Sequence[jax.Array], *,
                mesh: jax.sharding.Mesh, shardings: Sequence[NamedSharding],
                params: dict[str, Any]) -> jax.Array:
    """One device's GEMM on its shards. With K sharded: the float32 GEMM of its K-shard,
    summed over the devices holding the other K-shards (psum), then rounded once to
    out_dtype. That is the one-device GEMM's sum of float32 block products in another
    order (a summation tree of the same terms), so within the same bound
    (tests/kernels/test_block_gemm.py: the bounds hold whatever the order of the float32
    sum). GEMM-layout scales of a shard are padded (with 1.0) as the kernel reads them."""
    del mesh
    a, sa, b, sb = operands
    if params["scale_layout"] == "gemm":
        sa = pad_scales(sa)
        sb = pad_scales(sb)
    k_axes = specs.spec_axes(specs.padded_spec(shardings[0], a.ndim)[-1])
    if not k_axes:
        return cast(jax.Array, bind(a, sa, b, sb, **params))
    partial = bind(a, sa, b, sb, **dict(params, out_dtype=np.dtype(np.float32)))
    # jax.lax.psum is unannotated in JAX.
    return cast(jax.Array,
                jax.lax.psum(partial, k_axes).astype(params["out_dtype"]))  # type: ignore[no-untyped-call]


def _gemm_rule(params: dict[str, Any], operand_types: Sequence[Any],
               ) -> tuple[str, dict[str, Any]]:
    lead = tuple(f"b{i}" for i in range(len(operand_types[0].shape) - 2))
    gemm = params["scale_layout"] == "gemm"
    factors = (lead + ("m", "k"), _scale_spec(lead, "m", "k", params["a_block_rows"], gemm),
               lead + ("n", "k"), _scale_spec(lead, "n", "k", params["b_block_rows"], gemm))
    return (", ".join(" ".join(f) for f in factors) + " -> " + " ".join(lead + ("m", "n")),
            {"reduction_factors": ("k",)})


PARTITIONING = base.Partitioning(_gemm_shardings, _gemm_rule, local=_gemm_local,
                                 needs_kernel=False, explicit=True)

# Differentiated as the reference; batched in front (leading axes are independent GEMMs).
block_gemm_p = base.register(base.Spec(
    TARGET, _abstract_eval, reference, cache_reference=True, jvp="reference",
    kernels={"cuda": base.Kernel(_kernel_lowering, _kernel_supports, _kernel_refuses)},
    partitioning=PARTITIONING, same_varying=True))


def block_gemm(a: jax.Array, a_scale_inv: jax.Array, b: jax.Array, b_scale_inv: jax.Array, *,
               a_block_rows: int, b_block_rows: int, out_dtype: DTypeLike,
               implementation: str = "auto", scale_layout: str = "spec") -> jax.Array:
    """Binds the primitive: a [..., M, K], b [..., N, K] (with their scale_inv) -> [..., M, N];
    `implementation` is one of base.IMPLEMENTATIONS."""
    return cast(jax.Array, block_gemm_p.bind(
        a, a_scale_inv, b, b_scale_inv, a_block_rows=int(a_block_rows),
        b_block_rows=int(b_block_rows), out_dtype=np.dtype(out_dtype),
        implementation=implementation, scale_layout=scale_layout))
