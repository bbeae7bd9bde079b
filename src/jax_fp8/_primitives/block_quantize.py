"""The `jax_fp8_block_quantize` primitive: each 1x128 block or 128x128 tile of x quantized from its
own amax.

x [..., M, K] -> the row-wise copy (q [..., M, K], scale_inv
[..., M or ceil(M/128), ceil(K/128)]), the column-wise copy (the same for x with its last two
axes swapped: q_t [..., K, M], scale_inv_t) or both from one read of x. On CUDA one custom
call (one kernel); elsewhere, for FP8 types the kernel does not write, or with
``implementation="jnp"``, `quantize_reference`: the bit-exact arithmetic of exact.py, the
CUDA kernel's bits.

Under a jit over several devices (and on meshes with Explicit axes) each device quantizes
the shard it holds (`PARTITIONING`: the kernel on CUDA, the reference elsewhere): every
block lies within one shard, so the bits are one device's. An axis keeps its sharding
where each shard holds whole blocks along it (whole 128s along K for the row-wise copy;
along M for the column-wise copy and for 128 x 128 tiles) and, for the GEMM scale layout,
where the scales along the layout's padded axis need no padding globally; other axes are
gathered (in x's own type) before quantizing.

``scale_layout="gemm"`` gives each scale_inv in the layout the block GEMM reads
(``gemm_scale_shape``, padded with 1.0), which the kernel writes directly: the FP8 dot
needs no XLA op between its quantization and its GEMMs. ``to_gemm_layout`` /
``from_gemm_layout`` convert.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jax_fp8 import _registration, recipe as recipe_lib
from jax_fp8._primitives import base, kernel_types, partition_specs as specs
from jax_fp8._primitives.exact import (
    F32,
    U32,
    abs_bits,
    cast_scaled as cast_scaled,
    from_bits,
    pow2_inverse as pow2_inverse,
    scale_from_amax_f32 as scale_from_amax_f32,
    scale_inverse as scale_inverse,
    widen as widen,
)

BLOCK = 128
INPUT_DTYPES = kernel_types.WIDE_INPUTS   # what block quantization takes (its kernel reads)
KERNEL_FP8 = kernel_types.FP8_OUTPUTS


def scale_rows(m: int, block_rows: int) -> int:
    return m if block_rows == 1 else -(-m // block_rows)


SCALE_LAYOUTS = ("spec", "gemm")


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def gemm_scale_shape(shape: Sequence[int], block_rows: int) -> tuple[int, ...]:
    """The block GEMM's (cuBLASLt's) scale_inv shape for an operand [..., R, K], the
    layout of ffi/block_scale_layout.h: 1x128 blocks [..., ceil(K/128), round_up(R, 4)]
    (R contiguous), 128x128 tiles [..., ceil(R/128), round_up(ceil(K/128), 4)]."""
    *lead, r, k = shape
    kb = -(-k // BLOCK)
    tail = (kb, _round4(r)) if block_rows == 1 else (-(-r // BLOCK), _round4(kb))
    return tuple(lead) + tail


def scale_shape(shape: Sequence[int], block_rows: int, layout: str = "spec") -> tuple[int, ...]:
    """scale_inv's shape for an operand [..., R, K] in either layout."""
    if layout == "gemm":
        return gemm_scale_shape(shape, block_rows)
    *lead, r, k = shape
    return tuple(lead) + (scale_rows(r, block_rows), -(-k // BLOCK))


def to_gemm_layout(scale_inv: jax.Array, block_rows: int) -> jax.Array:
    """scale_inv [..., R or ceil(R/128), ceil(K/128)] in the GEMM layout (padded with 1.0)."""
    return pad_scales(jnp.swapaxes(scale_inv, -1, -2) if block_rows == 1 else scale_inv)


def pad_scales(s: jax.Array) -> jax.Array:
    """GEMM-layout scales `s` with their last axis padded with 1.0 to a multiple of 4, as
    the kernels read them."""
    pad = _round4(s.shape[-1]) - s.shape[-1]
    if not pad:
        return s
    return jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)], constant_values=1.0)


def from_gemm_layout(scale_inv: jax.Array, block_rows: int, r: int, k: int) -> jax.Array:
    """The inverse of to_gemm_layout for an operand [..., r, k]."""
    if block_rows == 1:
        return jnp.swapaxes(scale_inv[..., :r], -1, -2)
    kb = -(-k // BLOCK)
    return scale_inv[..., :kb]


def quantize_reference(x: Any, *, block_rows: int, fp8_dtype: DTypeLike,
                       power_of_2_scale: bool, amax_epsilon: float,
                       ) -> tuple[jax.Array, jax.Array]:
    """x [..., M, K] -> (q [..., M, K], scale_inv [..., M or ceil(M/128), ceil(K/128)])."""
    *lead, m, k = x.shape
    lead, b = tuple(lead), math.prod(lead)
    mb, kb = -(-m // block_rows), -(-k // BLOCK)
    pad = [(0, 0), (0, mb * block_rows - m), (0, kb * BLOCK - k)]
    xp = jnp.pad(widen(x.reshape(b, m, k)), pad).reshape(b, mb, block_rows, kb, BLOCK)
    amax = jnp.max(abs_bits(xp), axis=(2, 4), initial=U32(0))
    scale = scale_from_amax_f32(from_bits(amax), recipe_lib.fp8_max(fp8_dtype), amax_epsilon,
                                power_of_2_scale)
    q = lax.bitcast_convert_type(cast_scaled(xp, scale[:, :, None, :, None], fp8_dtype),
                                 jnp.uint8)
    # The padding is cut off as bytes: XLA:CPU (jax 0.11) slices FP8 arrays through a
    # float conversion that rewrites every E5M2 NaN as 0x7F.
    q = q.reshape(b, mb * block_rows, kb * BLOCK)[:, :m, :k].reshape(x.shape)
    q = lax.bitcast_convert_type(q, fp8_dtype)
    inverse = pow2_inverse(scale) if power_of_2_scale else scale_inverse(scale)
    return q, inverse.reshape(lead + (mb, kb))


# --------------------------------------------------------------------------- primitive

TARGET = "jax_fp8_block_quantize"


def _like(x: ShapedArray, shape: tuple[int, ...], dtype: DTypeLike) -> ShapedArray:
    # ShapedArray.update is unannotated in JAX.
    return cast(ShapedArray, x.update(shape=shape, dtype=dtype, weak_type=False))  # type: ignore[no-untyped-call]


def _abstract_eval(x: ShapedArray, *, block_rows: int, fp8_dtype: np.dtype, power_of_2_scale: bool,
                   amax_epsilon: float, rowwise: bool, colwise: bool, scale_layout: str,
                   ) -> list[ShapedArray]:
    del power_of_2_scale, amax_epsilon
    if x.ndim < 2 or np.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(f"jax_fp8_block_quantize: takes a float32/bfloat16/float16 array of "
                        f"rank >= 2, got {x.dtype}{list(x.shape)}")
    if block_rows not in (1, BLOCK) or not (rowwise or colwise) or \
            scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"jax_fp8_block_quantize: bad parameters block_rows={block_rows}, "
                         f"rowwise={rowwise}, colwise={colwise}, scale_layout={scale_layout}")
    *lead, m, k = x.shape
    lead = tuple(lead)
    outs = []
    if rowwise:
        outs += [_like(x, lead + (m, k), fp8_dtype),
                 _like(x, scale_shape(lead + (m, k), block_rows, scale_layout), np.float32)]
    if colwise:
        outs += [_like(x, lead + (k, m), fp8_dtype),
                 _like(x, scale_shape(lead + (k, m), block_rows, scale_layout), np.float32)]
    return outs


def _reference(x: jax.Array, *, block_rows: int, fp8_dtype: np.dtype, power_of_2_scale: bool,
               amax_epsilon: float, rowwise: bool, colwise: bool, scale_layout: str,
               ) -> list[jax.Array]:
    opts: dict[str, Any] = dict(block_rows=block_rows, fp8_dtype=fp8_dtype,
                                power_of_2_scale=power_of_2_scale, amax_epsilon=amax_epsilon)
    outs = []
    for wanted, a in ((rowwise, x), (colwise, jnp.swapaxes(x, -1, -2))):
        if wanted:
            q, s = quantize_reference(a, **opts)
            outs += [q, to_gemm_layout(s, block_rows) if scale_layout == "gemm" else s]
    return outs


def kernel_supports(shape: Sequence[int], dtype: DTypeLike, fp8_dtype: DTypeLike) -> bool:
    """Whether the CUDA kernel takes x: an input and FP8 type it reads and writes, and sizes
    its launcher takes (ffi/block_quantize_cuda.cu's BlockQuantizeSupports, asked of the
    CUDA module itself)."""
    *lead, m, k = shape
    batch = math.prod(lead)
    module = _registration.CUDA_MODULE
    return (module is not None and np.dtype(dtype) in INPUT_DTYPES
            and np.dtype(fp8_dtype) in KERNEL_FP8 and 0 < batch < 2 ** 63
            and module.block_quantize_supports(batch, int(m), int(k)))


def _kernel_lowering(ctx: Any, x: Any, *, block_rows: int, fp8_dtype: np.dtype,
                     power_of_2_scale: bool, amax_epsilon: float, rowwise: bool, colwise: bool,
                     scale_layout: str) -> Any:
    del fp8_dtype
    return jax.ffi.ffi_lowering(TARGET)(
        ctx, x, tile_2d=block_rows == BLOCK, rowwise=bool(rowwise), colwise=bool(colwise),
        amax_epsilon=F32(amax_epsilon), power_of_2_scale=bool(power_of_2_scale),
        gemm_layout=scale_layout == "gemm")


# ------------------------------------------------------------------------ partitioning

def _kept_axes(params: dict[str, Any], shape: Sequence[int], spec: Sequence[Any],
               mesh: jax.sharding.Mesh) -> tuple[Any, ...]:
    """x's PartitionSpec entries with each axis whose shards would cut a block (or make
    the GEMM layout's scales padded inside the array) replaced by None."""
    rows, rowwise, colwise = params["block_rows"], params["rowwise"], params["colwise"]
    gemm = params["scale_layout"] == "gemm"
    *lead, m, k = shape
    # Per axis: (whole 128-blocks per shard needed, scale counts along a padded GEMM axis)
    m_whole = colwise or (rowwise and rows == BLOCK)
    k_whole = rowwise or (colwise and rows == BLOCK)
    m_padded = [c for c, on in ((m, rowwise and rows == 1),
                                (-(-m // BLOCK), colwise and rows == BLOCK))
                if gemm and on]
    k_padded = [c for c, on in ((-(-k // BLOCK), rowwise and rows == BLOCK),
                                (k, colwise and rows == 1))
                if gemm and on]
    rules: list[tuple[bool, list[int]]] = ([(False, [])] * len(lead)
                                           + [(m_whole, m_padded), (k_whole, k_padded)])
    kept = []
    for n, entry, (whole, padded) in zip(shape, spec, rules):
        shards = specs.axes_size(mesh, specs.spec_axes(entry))
        kept.append(entry if shards_fit(n, shards, whole, padded) or shards == 1 else None)
    return tuple(kept)


def shards_fit(n: int, shards: int, whole: bool, padded_counts: Iterable[int]) -> bool:
    """Whether an axis of n values splits into `shards` equal pieces, each of whole
    128-blocks where `whole`, with every count of GEMM-layout scales along it in
    `padded_counts` a multiple of 4 (no padding inside the array)."""
    return (n % shards == 0 and not (whole and (n // shards) % BLOCK)
            and all(c % 4 == 0 for c in padded_counts))


def _result_specs(params: dict[str, Any], kept: Any) -> list[tuple[Any, ...]]:
    """The results' PartitionSpecs for x's kept spec (lead..., m, k)."""
    *lead, m, k = kept
    rows, gemm = params["block_rows"], params["scale_layout"] == "gemm"
    lead = tuple(lead)
    out = []
    if params["rowwise"]:   # q [M, K]; scales [kb, M] (gemm, 1x128) else [M or mb, kb]
        out += [lead + (m, k), lead + ((k, m) if gemm and rows == 1 else (m, k))]
    if params["colwise"]:   # q_t [K, M]; scales [mb, K] (gemm, 1x128) else [K or kb, mb]
        out += [lead + (k, m), lead + ((m, k) if gemm and rows == 1 else (k, m))]
    return out


def _shardings(params: dict[str, Any], mesh: jax.sharding.Mesh, arg_shapes: Sequence[Any],
               ) -> tuple[tuple[NamedSharding], tuple[NamedSharding, ...]]:
    (x,) = arg_shapes
    kept = _kept_axes(params, x.shape, specs.padded_spec(x.sharding, x.ndim), mesh)
    # PartitionSpec's constructor is unannotated in JAX.
    named: Callable[[Any], NamedSharding] = \
        lambda spec: NamedSharding(mesh, PartitionSpec(*spec))  # type: ignore[no-untyped-call]  # noqa: E731
    return (named(kept),), tuple(named(spec) for spec in _result_specs(params, kept))


def _local(bind: Callable[..., Any], operands: Sequence[jax.Array], *, mesh: jax.sharding.Mesh,
           shardings: Sequence[NamedSharding], params: dict[str, Any]) -> tuple[jax.Array, ...]:
    """One device's quantization; a GEMM-layout scale whose padded axis is sharded is cut
    to this device's scales (the kernel pads a shard's count to a multiple of 4, the
    global array holds no padding there)."""
    del mesh
    (x,) = operands
    outs = list(bind(x, **params))
    if params["scale_layout"] != "gemm":
        return tuple(outs)
    *_, m_entry, k_entry = specs.padded_spec(shardings[0], x.ndim)
    m, k = x.shape[-2:]
    rows = params["block_rows"]
    # (the padded axis is sharded, this device's count of scales along it) per copy
    row_cut = (m_entry, m) if rows == 1 else (k_entry, -(-k // BLOCK))
    col_cut = (k_entry, k) if rows == 1 else (m_entry, -(-m // BLOCK))
    cuts = ([row_cut] if params["rowwise"] else []) + ([col_cut] if params["colwise"] else [])
    for i, (entry, count) in enumerate(cuts):
        if entry is not None:
            outs[2 * i + 1] = outs[2 * i + 1][..., :count]
    return tuple(outs)


def _sharding_rule(params: dict[str, Any], operand_types: Sequence[Any],
                   ) -> tuple[str, dict[str, Any]]:
    lead = " ".join(f"b{i}" for i in range(len(operand_types[0].shape) - 2))
    specs = _result_specs(params, tuple(f"b{i}" for i in range(len(lead.split()))) + ("m", "k"))
    results = ", ".join(" ".join(spec) for spec in specs)
    return f"{lead} m k -> {results}".strip(), {}


PARTITIONING = base.Partitioning(_shardings, _sharding_rule, local=_local, needs_kernel=False,
                                 explicit=True)

# Quantization is not differentiated (stop-gradient): zero tangents. Leading axes are
# independent tensors: batched in front. Bit-exact per shard, so partitioned also where
# the reference runs (needs_kernel=False).
block_quantize_p = base.register(base.Spec(
    TARGET, _abstract_eval, _reference, multiple_results=True, cache_reference=True,
    kernels={"cuda": base.Kernel(
        _kernel_lowering,
        supports=lambda x, *, fp8_dtype, **_: kernel_supports(x.shape, x.dtype, fp8_dtype))},
    partitioning=PARTITIONING))


def block_quantize(x: jax.Array, *, block_rows: int, fp8_dtype: DTypeLike, power_of_2_scale: bool,
                   amax_epsilon: float, rowwise: bool = True, colwise: bool = False,
                   implementation: str = "auto", scale_layout: str = "spec") -> list[jax.Array]:
    """Binds the primitive (see the module docstring for the results); `implementation`
    is one of base.IMPLEMENTATIONS."""
    return cast("list[jax.Array]", block_quantize_p.bind(
        x, block_rows=int(block_rows), fp8_dtype=np.dtype(fp8_dtype),
        power_of_2_scale=bool(power_of_2_scale), amax_epsilon=float(amax_epsilon),
        rowwise=bool(rowwise), colwise=bool(colwise), implementation=implementation,
        scale_layout=scale_layout))
