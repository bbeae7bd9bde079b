"""The grouped FP8 weight-gradient primitive `jax_fp8_grouped_wgrad`: the weight gradient of a
mixture-of-experts layer's G GEMMs, a grouped GEMM ragged along its contraction (the tokens).

Shapes: lhs [M, K] and grad [M, N] FP8 (the quantized input and output gradient, tokens
sorted by expert), group_sizes int32 [G], lhs_scale_inv and grad_scale_inv float32 [G], out
[G, K, N] in `out_dtype`.

The numbers (the reference below, and the CUDA kernel's):

1. Groups: the sizes clamped in order as the grouped GEMM primitive clamps them
   (`grouped_gemm.clamped_group_ends`); rows past the last group take part in no group.
2. acc[g] = sum over group g's rows r of lhs[r, :]^T grad[r, :]: every product of two FP8
   values exact in float32, summed in float32 (in an order the implementation picks); an
   empty group's acc is 0. IEEE for infinities and NaNs, which stay in their group.
3. alpha_g = lhs_scale_inv[g] * grad_scale_inv[g], one float32 multiply.
4. out[g] = acc[g] * alpha_g, one float32 multiply, then one rounding to `out_dtype` (an
   empty group's out[g] is 0 * alpha_g: NaN where alpha_g is infinite or NaN).

The reference is a float32-accumulated ``jax.lax.ragged_dot_general`` of the FP8 operands
ragged along the contraction (`ragged_contract`), which XLA:GPU lowers by expanding the
operands into zero-padded dense [M, G, .] tensors: memory G times the operands'.

The CUDA kernel (ffi/grouped_wgrad_cuda.cc: the grouped GEMM's CUTLASS SM90 ptr-array kernel,
ffi/grouped_wgrad_sm90.cuh) takes each group as one GEMM of (M, N, K) = (K, N,
ceil16(m_g)) (the columns past its tokens are 0). FP8 wgmma reads both operands K-major
(the tokens contiguous), and TMA loads each group's operands only from 16-byte boundaries,
so the wrapper below first builds (`pad_transpose`: a gather of rows in XLA, then
ffi/transpose_cuda.cu's transpose of the bytes) lhs_t [K, Mp] and grad_t [N, Mp]: group g's tokens
in columns [pstart_g, pstart_g + m_g), pstart_g = sum over h < g of ceil16(m_h), every other
column 0, Mp = round16(M) + 16 * (G + 1) (`padded_columns`: the last 16 columns always 0; an
empty group's GEMM reads those, a contraction of 16 zeros). The tensor cores sum each 128
tokens (4 wgmma steps) and add them to a float32 accumulator; alpha_g is read per group in
the epilogue; one rounding writes bf16 or float32 (a float16 output: the kernel's float32,
rounded once by XLA). It takes E4M3 lhs x E4M3 or E5M2 grad (the E4M3 and HYBRID formats),
N % 8 == 0 (bf16 out) or N % 4 == 0 (float32 / float16 out), 1 <= G <= 2**20
(ffi/grouped_wgrad_limits.h); elsewhere the reference runs, and ``explain`` says why.

The kernel is **on by default** wherever it is built and takes the operands;
``JAX_FP8_GROUPED_WGRAD_KERNEL=0`` in the environment when jax_fp8 is imported (`KERNEL_ON`)
switches it off, and ``implementation="jnp"`` runs the reference whatever the switch says;
``explain``'s row for the primitive says which runs and why.

Under a jit over several devices with the kernel asked for (`PARTITIONING`), each device
runs this primitive on the rows it holds with unit scales (its float32 partial sums of the
global groups clamped to its rows), one float32 all-reduce sums them, and each device
scales and rounds once; with the kernel off XLA partitions the reference (the same
arithmetic). ``explain`` says which. Inside ``shard_map`` the primitive runs on each
device's rows.
"""

from __future__ import annotations

import functools
import os
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
from jax_fp8._primitives import base, grouped_gemm as gg, layout, partition_specs as specs

TARGET = "jax_fp8_grouped_wgrad"
# "1" (the default): the CUDA kernel runs where it is built and takes the operands; "0": the
# reference everywhere. Read once, when jax_fp8 is imported.
ENV = "JAX_FP8_GROUPED_WGRAD_KERNEL"
ENV_VALUES = ("0", "1")
_ENV_VALUE = os.environ.get(ENV, "1")
if _ENV_VALUE not in ENV_VALUES:
    raise ValueError(f"{ENV} must be one of {ENV_VALUES}, got {_ENV_VALUE!r}")
KERNEL_ON = _ENV_VALUE == "1"
IMPLEMENTATIONS = ("auto", "jnp", "cuda")
OFF_REASON = f"the grouped weight-gradient kernel is switched off ({ENV}=0 at import)"
_KERNEL_OUT = (np.dtype(jnp.bfloat16), np.dtype(np.float32))
_ALIGN = 16   # tokens per TMA boundary (16 bytes of FP8)


def _abstract_eval(lhs: ShapedArray, grad: ShapedArray, group_sizes: ShapedArray,
                   lhs_scale_inv: ShapedArray, grad_scale_inv: ShapedArray, *,
                   out_dtype: np.dtype, kernel: bool) -> ShapedArray:
    del kernel
    name = TARGET
    if lhs.ndim != 2 or grad.ndim != 2 or not gg.is_fp8(lhs.dtype) or not gg.is_fp8(grad.dtype):
        raise TypeError(f"{name}: need FP8 lhs [M, K] and grad [M, N], got "
                        f"{lhs.dtype}{list(lhs.shape)} and {grad.dtype}{list(grad.shape)}")
    if lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"{name}: lhs [M, K] and grad [M, N] must share M, got "
                         f"{list(lhs.shape)} and {list(grad.shape)}")
    if lhs.shape[0] > gg.MAX_ROWS:
        raise ValueError(f"{name}: M = {lhs.shape[0]} rows exceed int32 group sizes")
    if group_sizes.ndim != 1 or group_sizes.dtype != np.int32:
        raise ValueError(f"{name}: group_sizes must be int32[G], got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    g = group_sizes.shape[0]
    gg.check_scales_and_out(name, g, (("lhs_scale_inv", lhs_scale_inv),
                                      ("grad_scale_inv", grad_scale_inv)), out_dtype)
    # Not sharded along any axis (a jit over several devices partitions the reference).
    sharding = getattr(lhs, "sharding", None)
    # PartitionSpec's constructor and ShapedArray.update are unannotated in JAX.
    extra = {} if sharding is None else {
        "sharding": NamedSharding(sharding.mesh, PartitionSpec())}  # type: ignore[no-untyped-call]
    return cast(ShapedArray, lhs.update(  # type: ignore[no-untyped-call]
        shape=(g, lhs.shape[1], grad.shape[1]), dtype=np.dtype(out_dtype), weak_type=False,
        **extra))


def ragged_contract(a: jax.Array, b: jax.Array, ends: jax.Array,
                    precision: lax.PrecisionLike = None) -> jax.Array:
    """[G, K, N] float32: for each group g, a_g^T . b_g over the group's rows of a [M, K] and
    b [M, N] (FP8 or float32), the groups ending at the clamped `ends`; the rows past the last
    group take part in none. Both operands are masked per group, so a NaN stays in its
    group."""
    numbers = lax.RaggedDotDimensionNumbers(  # type: ignore[no-untyped-call]
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=())
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
    return lax.ragged_dot_general(a, b, sizes, numbers, precision=precision,
                                  preferred_element_type=jnp.float32)


def reference(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array,
              lhs_scale_inv: jax.Array, grad_scale_inv: jax.Array, *, out_dtype: DTypeLike,
              kernel: bool = False) -> jax.Array:
    """The module's numbers in jax.numpy: steps 1-4 of the module docstring."""
    del kernel
    ends = gg.clamped_group_ends(group_sizes, lhs.shape[0])
    acc = ragged_contract(lhs, grad, ends)
    alpha = lhs_scale_inv * grad_scale_inv
    return (acc * alpha[:, None, None]).astype(out_dtype)


# ------------------------------------------------------- the kernel's operand layout

def padded_columns(m: int, groups: int) -> int:
    """Mp, the padded token axis of the kernel's operands for M rows and G groups:
    round16(M) + 16 * (G + 1), room for every group starting on a 16-column boundary
    (sum of ceil16(m_g) <= round16(M) + 16 * G) and 16 zero columns after them."""
    return -(-m // _ALIGN) * _ALIGN + _ALIGN * (groups + 1)


def column_starts(ends: jax.Array) -> jax.Array:
    """pstart [G] (int32): group g's first column in the padded operands, the sum over
    h < g of ceil16(m_h) for the clamped sizes m_h."""
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
    padded = (sizes + (_ALIGN - 1)) // _ALIGN * _ALIGN
    return jnp.cumsum(padded) - padded


def padded_rows(ends: jax.Array, mp: int) -> tuple[jax.Array, jax.Array]:
    """For each of the mp padded columns: the row of x it holds and whether it holds one
    (group g's rows, the clamped `ends`, in columns [pstart_g, pstart_g + m_g))."""
    groups = ends.shape[0]
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
    starts = ends - sizes
    pstart = column_starts(ends)
    cols = jnp.arange(mp, dtype=jnp.int32)
    # the group of each column: the last group whose first column is at or before it
    # (empty groups, sharing their first column with the next, are skipped by side="right")
    group = jnp.clip(jnp.searchsorted(pstart, cols, side="right").astype(jnp.int32) - 1,
                     0, groups - 1)
    offset = cols - pstart[group]
    inside = (offset >= 0) & (offset < sizes[group])
    return jnp.where(inside, starts[group] + offset, 0), inside


def _transpose_bytes(x: jax.Array) -> jax.Array:
    """[R, C] -> [C, R] of a 1-byte array: layout.py's custom call (ffi/transpose_cuda.cu)
    where the CUDA module is loaded and takes the sizes, else XLA's transpose. Only called
    from the CUDA lowering."""
    if layout.kernel_supports(*x.shape):
        return layout._ffi_rotate(x, k=1)
    return x.T


def pad_transpose(x: jax.Array, ends: jax.Array, mp: int, *,
                  transpose: Callable[[jax.Array], jax.Array] = lambda t: t.T) -> jax.Array:
    """x [M, C] (FP8) -> [C, mp]: group g's rows (the clamped `ends`) in columns
    [pstart_g, pstart_g + m_g) (`column_starts`), every other column 0 (rows past the last
    group are not copied). A gather of rows (as 32-bit words where C % 4 == 0: a quarter of
    the elements) and a `transpose` of the bytes."""
    groups = ends.shape[0]
    if x.shape[0] == 0 or groups == 0:
        return jnp.zeros((x.shape[1], mp), x.dtype)
    rows, inside = padded_rows(ends, mp)
    m, c = x.shape
    if c % 4 == 0:
        words = lax.bitcast_convert_type(x.reshape(m, c // 4, 4), jnp.uint32)
        picked_words = jnp.where(inside[:, None], words[rows], jnp.uint32(0))
        picked = lax.bitcast_convert_type(picked_words, jnp.uint8).reshape(mp, c)
    else:
        picked = jnp.where(inside[:, None], lax.bitcast_convert_type(x, jnp.uint8)[rows],
                           jnp.uint8(0))                                  # [mp, C]
    return lax.bitcast_convert_type(transpose(picked), x.dtype)


# ------------------------------------------------------------------------- the kernel

def kernel_configs() -> tuple[str, ...]:
    """Names of the weight-gradient configurations compiled into the CUDA module."""
    return gg.compiled_configs("grouped_wgrad_configs")


@functools.cache
def kernel_status() -> tuple[bool, str]:
    """(whether the weight-gradient kernel can run in this process, why not)."""
    return gg.cutlass_status(kernel_configs(), "grouped weight-gradient")


def kernel_supports(lhs: Any, grad: Any, groups: int, out_dtype: DTypeLike) -> bool:
    """Whether the kernel takes lhs [M, K]^T . grad [M, N] for `groups` groups into
    `out_dtype`: ffi/grouped_wgrad_limits.h's GroupedWgradSupports on the padded operands,
    asked of the built module (either carries it); False where neither is built."""
    module = _registration.CUDA_MODULE or _registration.CPU_MODULE
    if module is None or not hasattr(module, "grouped_wgrad_supports"):
        return False
    call_out = np.float32 if np.dtype(out_dtype) == np.float16 else out_dtype
    m, k = lhs.shape
    n = grad.shape[1]
    return cast(bool, module.grouped_wgrad_supports(
        np.dtype(lhs.dtype).name, np.dtype(grad.dtype).name, np.dtype(call_out).name, int(k),
        int(n), int(padded_columns(m, groups)), int(groups)))


def _refuses(lhs: ShapedArray, grad: ShapedArray, group_sizes: ShapedArray,
             lhs_scale_inv: ShapedArray, grad_scale_inv: ShapedArray, *,
             out_dtype: np.dtype, kernel: bool) -> str | None:
    del lhs_scale_inv, grad_scale_inv
    if not kernel:
        return OFF_REASON
    ok, why = kernel_status()
    if not ok:
        return why
    if not kernel_supports(lhs, grad, group_sizes.shape[0], out_dtype):
        return ("the grouped weight-gradient kernel does not take these operands (it takes "
                "E4M3 lhs x E4M3 or E5M2 grad, N % 8 == 0 for bfloat16 out or N % 4 == 0 for "
                "float32 / float16 out, K >= 1, 1 <= G <= 2**20)")
    return None


def _ffi_grouped_wgrad(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array,
                       lhs_scale_inv: jax.Array, grad_scale_inv: jax.Array, *,
                       out_dtype: np.dtype, kernel: bool) -> jax.Array:
    del kernel
    m, k, n, g = lhs.shape[0], lhs.shape[1], grad.shape[1], group_sizes.shape[0]
    ends = gg.clamped_group_ends(group_sizes, m)
    mp = padded_columns(m, g)
    lhs_t = pad_transpose(lhs, ends, mp, transpose=_transpose_bytes)
    grad_t = pad_transpose(grad, ends, mp, transpose=_transpose_bytes)
    # float16 out: the kernel writes float32, one convert rounds it (as the reference does)
    kernel_dtype = out_dtype if np.dtype(out_dtype) in _KERNEL_OUT else np.dtype(np.float32)
    call = jax.ffi.ffi_call(TARGET, (
        jax.ShapeDtypeStruct((g, k, n), kernel_dtype),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((gg.workspace_bytes(g),), jnp.uint8)))  # type: ignore[no-untyped-call]
    # the kernel clamps group_sizes to m rows as clamped_group_ends does (the same columns)
    out, _ = call(lhs_t, grad_t, group_sizes, lhs_scale_inv, grad_scale_inv, m=np.int64(m))
    return out.astype(out_dtype)


def _kernel_lowering(ctx: Any, *operands: Any, **params: Any) -> Any:
    return mlir.lower_fun(functools.partial(_ffi_grouped_wgrad, **params),
                          multiple_results=False)(ctx, *operands)


# ----------------------------------------------------------------------- partitioning
# With the kernel asked for (the switch on, or implementation="cuda"), under a jit over
# several devices each device runs the primitive (the kernel where it runs, else the
# reference) on the rows of lhs and grad it holds, with unit scales: its float32 partial
# sums acc_d[g] over its rows of each group (the global groups clamped to its rows, computed
# on the device, as the grouped GEMM's rule does). One float32 all-reduce sums them over the
# devices holding the rows, then each device scales and rounds once: out[g] =
# (sum_d acc_d[g]) * alpha_g. K and N are gathered (FP8); the result is replicated. With the
# kernel off XLA partitions the reference (the same arithmetic: partial sums, one
# all-reduce, one scale and rounding).

def _m_entry(mesh: jax.sharding.Mesh, lhs: Any) -> Any:
    """lhs's M sharding entry where its shards are even, else None."""
    entry = specs.padded_spec(lhs.sharding, 2)[0]
    axes = specs.spec_axes(entry)
    if not axes or lhs.shape[0] % specs.axes_size(mesh, axes):
        return None
    return entry


def _wgrad_shardings(params: dict[str, Any], mesh: jax.sharding.Mesh, arg_shapes: Sequence[Any],
                     ) -> tuple[tuple[NamedSharding, ...], NamedSharding]:
    del params
    m = _m_entry(mesh, arg_shapes[0])
    # PartitionSpec's constructor is unannotated in JAX.
    named: Callable[..., NamedSharding] = \
        lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))  # type: ignore[no-untyped-call]  # noqa: E731
    return ((named(m, None), named(m, None), named(), named(), named()),
            named(None, None, None))


def _wgrad_local(bind: Callable[..., Any], operands: Sequence[jax.Array], *,
                 mesh: jax.sharding.Mesh, shardings: Sequence[NamedSharding],
                 params: dict[str, Any]) -> Any:
    """One device's rows: its partial sums of the global groups clamped to them, summed
    over the devices in float32, then scaled and rounded once."""
    lhs, grad, group_sizes, lhs_scale_inv, grad_scale_inv = operands
    m_axes = specs.spec_axes(specs.padded_spec(shardings[0], 2)[0])
    if not m_axes:
        return bind(*operands, **params)
    local_m = lhs.shape[0]
    local = gg.local_group_sizes(group_sizes, local_m, mesh, m_axes)
    ones = jnp.ones_like(lhs_scale_inv)
    acc = bind(lhs, grad, local, ones, ones,
               **dict(params, out_dtype=np.dtype(np.float32)))     # acc * (1 * 1): exact
    acc = lax.psum(acc, m_axes)  # type: ignore[no-untyped-call]  # unannotated in JAX
    alpha = lhs_scale_inv * grad_scale_inv
    return (acc * alpha[:, None, None]).astype(params["out_dtype"])


def _wgrad_rule(params: dict[str, Any], operand_types: Sequence[Any],
                ) -> tuple[str, dict[str, Any]]:
    del params, operand_types
    return "m k, m n, g, g, g -> g k n", {"reduction_factors": ("m",)}


def _wgrad_partitions(*avals: Any, kernel: bool, **params: Any) -> bool:
    """Partition (per device, then one all-reduce) only with the kernel asked for."""
    del avals, params
    return kernel


PARTITIONING = base.Partitioning(_wgrad_shardings, _wgrad_rule, local=_wgrad_local,
                                 supports=_wgrad_partitions, needs_kernel=False)

# Differentiated and batched as the reference.
grouped_wgrad_p = base.register(base.Spec(
    TARGET, _abstract_eval, reference, cache_reference=True, jvp="reference", batch="reference",
    kernels={"cuda": base.Kernel(_kernel_lowering, refuses=_refuses)}, same_varying=True,
    partitioning=PARTITIONING))


def grouped_wgrad(lhs: jax.Array, grad: jax.Array, group_sizes: jax.Array,
                  lhs_scale_inv: jax.Array, grad_scale_inv: jax.Array, *, out_dtype: DTypeLike,
                  implementation: str = "auto") -> jax.Array:
    """Binds the primitive: lhs [M, K], grad [M, N] (FP8), group_sizes int32 [G],
    lhs_scale_inv and grad_scale_inv float32 [G] -> out [G, K, N] in `out_dtype` (bfloat16,
    float16 or float32), the numbers of the module docstring.

    implementation: "auto" (the CUDA kernel where it is built and takes the operands, unless
    ``JAX_FP8_GROUPED_WGRAD_KERNEL=0`` was set when jax_fp8 was imported; else the
    reference), "cuda" (the CUDA kernel where it is built and takes the operands, whatever
    the switch says; else the reference) or "jnp" (the reference).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{TARGET}: implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")
    kernel = implementation == "cuda" or (implementation == "auto" and KERNEL_ON)
    return cast(jax.Array, grouped_wgrad_p.bind(
        lhs, grad, group_sizes, lhs_scale_inv, grad_scale_inv, out_dtype=np.dtype(out_dtype),
        kernel=kernel, implementation="jnp" if implementation == "jnp" else "auto"))
