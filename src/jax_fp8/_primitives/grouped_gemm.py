"""The grouped FP8 GEMM primitive `jax_fp8_grouped_gemm`: a mixture-of-experts layer's G GEMMs,
each over its own group of consecutive rows, with each group's two scale_inv factors.

Shapes: lhs [M, K] and rhs [G, N, K] FP8 (both contracting over their last axis, the "TN"
layout of the FFI GEMMs), group_sizes int32 [G], lhs_scale_inv and rhs_scale_inv float32
[G], out [M, N] in `out_dtype`.

The numbers (the reference below, and the CUDA kernel's):

1. Groups: the sizes are clamped in order, size_g' = min(max(size_g, 0), M - offset_g), with
   offset_g = size_0' + ... + size_{g-1}' (negative sizes count as 0; a group reaching past
   row M is cut there). Group g owns rows [offset_g, offset_g + size_g').
2. acc = ``jax.lax.ragged_dot`` of the FP8 operands with ``preferred_element_type=float32``
   (rhs[g] transposed): each product of two FP8 values is exact in float32, summed over K in
   float32 (in an order the implementation picks); IEEE for infinities and NaNs, which stay
   in their group's rows (see `reference` for the weights where jax's ragged_dot would not).
3. alpha_g = lhs_scale_inv[g] * rhs_scale_inv[g], one float32 multiply (rounded to nearest
   even).
4. out[r] = acc[r] * alpha_g for each row r of group g: one float32 multiply, then one
   rounding to `out_dtype`. Rows from offset_G to M are 0 (whatever the scales are).

So the scales are applied after the sum, as the product of the two, never to the operands.
XLA flushes float32 subnormal results to zero (a subnormal alpha_g, or a subnormal
acc * alpha_g, reads as a zero of its sign in the reference); the kernel keeps them.

On CUDA the kernel (ffi/grouped_gemm_cuda.cc: CUTLASS's SM90 ptr-array grouped GEMM,
ffi/grouped_gemm_sm90.cuh) computes steps 1-4 on the device from `group_sizes` (no host
synchronization): the tensor cores sum each 128 values of K (4 wgmma steps) and add them to a
float32 accumulator, alpha_g is read per group from device memory, and one float32 multiply
and one rounding write the output (a float16 output: the kernel's float32, rounded once by
XLA). It takes E4M3 or E5M2 lhs x E4M3 rhs, K % 16 == 0, N % 8 == 0 (bf16 out) or
N % 4 == 0 (float32 / float16 out), 1 <= G <= 2**20 (ffi/grouped_gemm_limits.h): TMA needs
every group's rows on 16-byte boundaries. Elsewhere the reference runs, and `explain` says why.

The weight gradient of a grouped GEMM (ragged along the contraction: lhs_g^T . grad_g per
group) is not this primitive but `grouped_wgrad`'s. FP8 wgmma reads both operands K-major,
so it needs the token axis contiguous (transposed copies of both), and TMA loads each
group's operands only from 16-byte boundaries: `grouped_wgrad` transposes and pads them
per group (each group's tokens from a multiple of 16) and runs this kernel on them.

Under a jit over several devices (and on meshes with Explicit axes) each device runs this
GEMM on the rows of lhs it holds (`PARTITIONING`): M keeps lhs's sharding, N rhs's; the
experts' axis G and K are gathered, as FP8, and each device's group sizes are the global
groups clamped to its rows (computed on the device), so every row's bits are one device's.

The kernel is **on by default** wherever it is built and takes the operands (measured:
docs/benchmarks.md, "Grouped FP8 GEMMs"); ``JAX_FP8_GROUPED_GEMM=off`` in the environment
(read where `grouped_gemm` is traced) or ``implementation="jnp"`` runs the reference, and
``explain``'s row for the primitive says which runs and why.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Iterable, Sequence
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
from jax_fp8._primitives import axis_types, base, kernel_types, partition_specs as specs

TARGET = "jax_fp8_grouped_gemm"
# "auto" (default): the CUDA kernel runs where it is built and takes the operands; "off":
# the reference everywhere. Read where grouped_gemm is traced.
ENV = "JAX_FP8_GROUPED_GEMM"
ENV_VALUES = ("auto", "off")
IMPLEMENTATIONS = ("auto", "jnp", "cuda")
OFF_REASON = f"the grouped GEMM kernel is switched off ({ENV}=off)"
OUT_TYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
MAX_ROWS = 2 ** 31 - 1   # group sizes are int32


def is_fp8(dtype: DTypeLike) -> bool:
    return cast(bool, np.dtype(dtype).name.startswith("float8"))


def check_scales_and_out(name: str, g: int, scales: Iterable[tuple[str, Any]],
                         out_dtype: DTypeLike) -> None:
    """Raises unless each (label, aval) of ``scales`` is float32[g] (one scale inverse per
    group) and ``out_dtype`` is one of `OUT_TYPES`: the checks a grouped GEMM primitive's
    abstract evaluation shares."""
    for label, s in scales:
        if s.shape != (g,) or s.dtype != np.float32:
            raise ValueError(f"{name}: {label} must be float32[{g}] (one per group), got "
                             f"{s.dtype}{list(s.shape)}")
    if np.dtype(out_dtype) not in OUT_TYPES:
        raise TypeError(f"{name}: out_dtype must be one of bfloat16, float16, float32, got "
                        f"{np.dtype(out_dtype)}")


def _abstract_eval(lhs: ShapedArray, rhs: ShapedArray, group_sizes: ShapedArray,
                   lhs_scale_inv: ShapedArray, rhs_scale_inv: ShapedArray, *,
                   out_dtype: np.dtype, kernel: bool) -> ShapedArray:
    del kernel
    name = TARGET
    if lhs.ndim != 2 or rhs.ndim != 3 or not is_fp8(lhs.dtype) or not is_fp8(rhs.dtype):
        raise TypeError(f"{name}: need FP8 lhs [M, K] and rhs [G, N, K], got "
                        f"{lhs.dtype}{list(lhs.shape)} and {rhs.dtype}{list(rhs.shape)}")
    if rhs.shape[2] != lhs.shape[1]:
        raise ValueError(f"{name}: lhs [M, K] and rhs [G, N, K] must share K, got "
                         f"{list(lhs.shape)} and {list(rhs.shape)}")
    if lhs.shape[0] > MAX_ROWS:
        raise ValueError(f"{name}: M = {lhs.shape[0]} rows exceed int32 group sizes")
    g = rhs.shape[0]
    if group_sizes.shape != (g,) or group_sizes.dtype != np.int32:
        raise ValueError(f"{name}: group_sizes must be int32[{g}] (one size per group of "
                         f"rhs), got {group_sizes.dtype}{list(group_sizes.shape)}")
    check_scales_and_out(name, g, (("lhs_scale_inv", lhs_scale_inv),
                                   ("rhs_scale_inv", rhs_scale_inv)), out_dtype)
    return cast(ShapedArray, lhs.update(  # type: ignore[no-untyped-call]
        shape=(lhs.shape[0], rhs.shape[1]), dtype=np.dtype(out_dtype), weak_type=False))


def clamped_group_ends(group_sizes: jax.Array, m: int) -> jax.Array:
    """The end row of each group (int32 [G]) under the module's clamping: the prefix sums of
    the sizes clamped to [0, m], each sum capped at m (a saturating scan: no overflow)."""
    sizes = jnp.clip(group_sizes, 0, m).astype(jnp.uint32)
    cap = jnp.uint32(m)
    ends = lax.associative_scan(lambda a, b: jnp.minimum(a + b, cap), sizes)
    return cast(jax.Array, ends.astype(jnp.int32))


def row_groups(ends: jax.Array, m: int) -> jax.Array:
    """The group of each of m rows (int32 [m]) for the clamped group ends: G for the rows
    past the last group."""
    rows = jnp.arange(m, dtype=jnp.int32)
    return jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)


def ragged_product(lhs: jax.Array, rhs: jax.Array, ends: jax.Array,
                   precision: lax.PrecisionLike = None) -> jax.Array:
    """acc [M, N] float32: each row of lhs [M, K] times its group's rhs[g] [N, K] (groups as
    the clamped `ends` say), the rows past the last group 0; IEEE for infinities and NaNs,
    which stay in their group's rows. lhs and rhs: FP8 (exact products) or float32."""
    m, n = lhs.shape[0], rhs.shape[1]
    group = row_groups(ends, m)

    def ragged(_: None) -> jax.Array:
        sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
        numbers = lax.RaggedDotDimensionNumbers(  # type: ignore[no-untyped-call]
            dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,),
            rhs_group_dimensions=(0,))
        return lax.ragged_dot_general(lhs, rhs, sizes, numbers, precision=precision,
                                      preferred_element_type=jnp.float32)

    def per_group(_: None) -> jax.Array:
        # Each group's rows from its own dense product: IEEE for every row.
        def body(g: jax.Array, acc: jax.Array) -> jax.Array:
            prod = lax.dot_general(lhs, rhs[g], (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
            return jnp.where((group == g)[:, None], prod, acc)
        # (inside shard_map the carry varies as the operands do)
        init = axis_types.vary_like([jnp.zeros((m, n), jnp.float32), lhs, rhs])[0]
        return cast(jax.Array, lax.fori_loop(0, rhs.shape[0], body, init))

    # jax's ragged_dot computes every row against every group's weights (masking the rows of
    # lhs, not the products), so an infinite or NaN weight of one expert would reach every
    # group's rows as 0 * inf = NaN; such weights take the per-group loop (G times the
    # FLOPs, only then).
    return cast(jax.Array, lax.cond(jnp.all(jnp.isfinite(rhs)), ragged, per_group, None))


def reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
              lhs_scale_inv: jax.Array, rhs_scale_inv: jax.Array, *, out_dtype: DTypeLike,
              kernel: bool = False) -> jax.Array:
    """The module's numbers in jax.numpy: steps 1-4 of the module docstring."""
    del kernel
    m, n = lhs.shape[0], rhs.shape[1]
    if rhs.shape[0] == 0 or m == 0:
        return jnp.zeros((m, n), out_dtype)
    ends = clamped_group_ends(group_sizes, m)
    group = row_groups(ends, m)
    inside = jnp.arange(m, dtype=jnp.int32) < ends[-1]
    acc = ragged_product(lhs, rhs, ends)
    alpha = lhs_scale_inv * rhs_scale_inv
    row_alpha = jnp.where(inside, alpha[jnp.minimum(group, alpha.shape[0] - 1)], 0.0)
    out = jnp.where(inside[:, None], acc * row_alpha[:, None], 0.0)
    return out.astype(out_dtype)


def compiled_configs(listing: str) -> tuple[str, ...]:
    """Names of the CUTLASS configurations the CUDA module lists with its function
    ``listing`` (e.g. "grouped_gemm_configs"); empty without the CUDA module or CUTLASS."""
    if not _registration.HAS_CUDA_KERNEL:
        return ()
    module = importlib.import_module("jax_fp8._jax_fp8_cuda")
    if not hasattr(module, listing):
        return ()
    return tuple(entry[0] for entry in getattr(module, listing)())


def cutlass_status(configs: tuple[str, ...], kernel: str) -> tuple[bool, str]:
    """(whether a CUTLASS sm_90a kernel whose compiled configurations are ``configs`` can run
    in this process, why not): the CUDA module built with CUTLASS, and SM90 GPUs present;
    ``kernel`` names it in the reason ("grouped GEMM")."""
    if not _registration.HAS_CUDA_KERNEL:
        return False, "the CUDA module was not built"
    if not configs:
        return False, ("the CUDA module was built without CUTLASS (nvidia-cutlass's headers "
                       f"were not found, or JAX_FP8_CUTLASS=OFF): no {kernel} kernel")
    sm90, caps = _registration.local_gpus_are_sm90()
    if not sm90:
        return False, f"the {kernel} kernel is built for sm_90a, found {caps}"
    return True, f"CUTLASS sm_90a {kernel}: {', '.join(configs)}"


def kernel_configs() -> tuple[str, ...]:
    """Names of the grouped GEMM configurations compiled into the CUDA module."""
    return compiled_configs("grouped_gemm_configs")


@functools.cache
def kernel_status() -> tuple[bool, str]:
    """(whether the grouped GEMM kernel can run in this process, why not)."""
    return cutlass_status(kernel_configs(), "grouped GEMM")


def kernel_supports(lhs: Any, rhs: Any, out_dtype: DTypeLike) -> bool:
    """Whether the kernel takes lhs [M, K] . rhs [G, N, K] into `out_dtype` (abstract values
    or anything with shape and dtype): ffi/grouped_gemm_limits.h's GroupedGemmSupports,
    asked of the built module (either carries it); False where neither is built."""
    module = _registration.CUDA_MODULE or _registration.CPU_MODULE
    if module is None or not hasattr(module, "grouped_gemm_supports"):
        return False
    m, k = lhs.shape
    g, n, _ = rhs.shape
    return cast(bool, module.grouped_gemm_supports(
        np.dtype(lhs.dtype).name, np.dtype(rhs.dtype).name,
        kernel_types.gemm_output(out_dtype).name, int(m), int(n), int(k), int(g)))


def workspace_bytes(groups: int) -> int:
    """The bytes of the custom call's workspace result (ffi/grouped_gemm_workspace.h)."""
    module = _registration.CUDA_MODULE or _registration.CPU_MODULE
    return int(module.grouped_gemm_workspace_bytes(int(groups)))


def _refuses(lhs: ShapedArray, rhs: ShapedArray, group_sizes: ShapedArray,
             lhs_scale_inv: ShapedArray, rhs_scale_inv: ShapedArray, *,
             out_dtype: np.dtype, kernel: bool) -> str | None:
    del group_sizes, lhs_scale_inv, rhs_scale_inv
    if not kernel:
        return OFF_REASON
    ok, why = kernel_status()
    if not ok:
        return why
    if not kernel_supports(lhs, rhs, out_dtype):
        return ("the grouped GEMM kernel does not take these operands (it takes E4M3 or E5M2 "
                "lhs x E4M3 rhs, K % 16 == 0, N % 8 == 0 for bfloat16 out or N % 4 == 0 for "
                "float32 / float16 out, 1 <= G <= 2**20)")
    return None


def _ffi_grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                      lhs_scale_inv: jax.Array, rhs_scale_inv: jax.Array, *,
                      out_dtype: np.dtype, kernel: bool) -> jax.Array:
    del kernel
    m, n, g = lhs.shape[0], rhs.shape[1], rhs.shape[0]
    kernel_dtype = kernel_types.gemm_output(out_dtype)
    call = jax.ffi.ffi_call(TARGET, (
        jax.ShapeDtypeStruct((m, n), kernel_dtype),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((workspace_bytes(g),), jnp.uint8)))  # type: ignore[no-untyped-call]
    out, _ = call(lhs, rhs, group_sizes, lhs_scale_inv, rhs_scale_inv)
    return out.astype(out_dtype)


def _kernel_lowering(ctx: Any, *operands: Any, **params: Any) -> Any:
    return mlir.lower_fun(functools.partial(_ffi_grouped_gemm, **params),
                          multiple_results=False)(ctx, *operands)


# ----------------------------------------------------------------------- partitioning
# Under a jit over several devices each device runs the grouped GEMM on the rows of lhs it
# holds (M keeps its sharding: tokens data-parallel) against every expert's weight, N
# keeping rhs's sharding (column-parallel experts); the experts' axis G and K are gathered,
# as FP8 (1 byte a value: experts' weights sharded over devices, FSDP-style, move as FP8).
# A device's rows [r0, r0 + M_local) meet the groups clamped to them: its group sizes are
# computed on the device from the global ones, so the bits of every row are one device's.

def _grouped_specs(mesh: jax.sharding.Mesh, lhs_shape: Sequence[int], lhs_spec: Sequence[Any],
                   rhs_shape: Sequence[int], rhs_spec: Sequence[Any]) -> tuple[Any, Any]:
    """(m, n) PartitionSpec entries: lhs's M where its shards are even, rhs's N where they
    are and its mesh axes are not M's."""
    used: set[str] = set()

    def take(entry: Any, size: int) -> Any:
        axes = specs.spec_axes(entry)
        if not axes or used & set(axes) or size % specs.axes_size(mesh, axes):
            return None
        used.update(axes)
        return entry

    return take(lhs_spec[0], lhs_shape[0]), take(rhs_spec[1], rhs_shape[1])


def _grouped_shardings(params: dict[str, Any], mesh: jax.sharding.Mesh, arg_shapes: Sequence[Any],
                       ) -> tuple[tuple[NamedSharding, ...], NamedSharding]:
    del params
    lhs, rhs = arg_shapes[:2]
    m, n = _grouped_specs(mesh, lhs.shape, specs.padded_spec(lhs.sharding, 2), rhs.shape,
                          specs.padded_spec(rhs.sharding, 3))
    # PartitionSpec's constructor is unannotated in JAX.
    named: Callable[..., NamedSharding] = \
        lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # type: ignore[no-untyped-call]  # noqa: E731
    return ((named(m, None), named(None, n, None), named(), named(), named()),
            named(m, n))


def local_group_sizes(group_sizes: jax.Array, local_m: int, mesh: jax.sharding.Mesh,
                      m_axes: tuple[str, ...]) -> jax.Array:
    """Inside a per-device computation over the token axis sharded on ``m_axes`` (each device
    ``local_m`` rows, in order): this device's group sizes (int32 [G]), the global groups
    (clamped as `clamped_group_ends` clamps them) clamped to its rows."""
    ends = clamped_group_ends(group_sizes, local_m * specs.axes_size(mesh, m_axes))
    starts = ends - jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
    first = lax.axis_index(m_axes).astype(jnp.int32) * local_m
    local = jnp.clip(ends - first, 0, local_m) - jnp.clip(starts - first, 0, local_m)
    return local.astype(jnp.int32)


def _grouped_local(bind: Callable[..., Any], operands: Sequence[jax.Array], *,
                   mesh: jax.sharding.Mesh, shardings: Sequence[NamedSharding],
                   params: dict[str, Any]) -> Any:
    """One device's rows: the global groups clamped to them."""
    lhs, rhs, group_sizes, lhs_scale_inv, rhs_scale_inv = operands
    m_axes = specs.spec_axes(specs.padded_spec(shardings[0], 2)[0])
    if not m_axes:
        return bind(*operands, **params)
    local_m = lhs.shape[0]
    local = local_group_sizes(group_sizes, local_m, mesh, m_axes)
    return bind(lhs, rhs, local, lhs_scale_inv, rhs_scale_inv, **params)


def _grouped_rule(params: dict[str, Any], operand_types: Sequence[Any],
                  ) -> tuple[str, dict[str, Any]]:
    del params, operand_types
    return "m k, g n k, g, g, g -> m n", {"need_replication_factors": ("k", "g")}


PARTITIONING = base.Partitioning(_grouped_shardings, _grouped_rule, local=_grouped_local,
                                 needs_kernel=False, explicit=True)

# Differentiated and batched as the reference.
grouped_gemm_p = base.register(base.Spec(
    TARGET, _abstract_eval, reference, cache_reference=True, jvp="reference", batch="reference",
    kernels={"cuda": base.Kernel(_kernel_lowering, refuses=_refuses)}, same_varying=True,
    partitioning=PARTITIONING))


def kernel_switch() -> bool:
    """Whether ``implementation="auto"`` may run the CUDA kernel: ``JAX_FP8_GROUPED_GEMM``
    is "auto" (the default), not "off"."""
    value = os.environ.get(ENV, "auto")
    if value not in ENV_VALUES:
        raise ValueError(f"{ENV} must be one of {ENV_VALUES}, got {value!r}")
    return value == "auto"


def grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                 lhs_scale_inv: jax.Array, rhs_scale_inv: jax.Array, *, out_dtype: DTypeLike,
                 implementation: str = "auto") -> jax.Array:
    """Binds the primitive: lhs [M, K], rhs [G, N, K] (FP8), group_sizes int32 [G],
    lhs_scale_inv and rhs_scale_inv float32 [G] -> out [M, N] in `out_dtype` (bfloat16,
    float16 or float32), the numbers of the module docstring.

    implementation: "auto" (the CUDA kernel where it is built and takes the operands, unless
    ``JAX_FP8_GROUPED_GEMM=off``; else the reference), "cuda" (the CUDA kernel where it is
    built and takes the operands, whatever the environment says; else the reference) or
    "jnp" (the reference).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{TARGET}: implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    kernel = implementation == "cuda" or (implementation == "auto" and kernel_switch())
    return cast(jax.Array, grouped_gemm_p.bind(
        lhs, rhs, group_sizes, lhs_scale_inv, rhs_scale_inv, out_dtype=np.dtype(out_dtype),
        kernel=kernel, implementation="jnp" if implementation == "jnp" else "auto"))
