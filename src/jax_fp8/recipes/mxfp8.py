"""MXFP8 (the OCP Microscaling format, Transformer Engine's ``MXFP8BlockScaling``): one E8M0
power-of-two scale per 32 consecutive values along the contraction axis K.

The numbers (docs/semantics.md, "MXFP8"): a block's amax is ``fmaxf(0, |x_1|, ..., |x_32|)``
(NaN ignored), ``v = amax * float32(1 / fp8_max)`` in IEEE float32 (subnormals kept), its
E8M0 exponent ``e`` is v's biased exponent rounded up to the next power of two (Transformer
Engine's ``float_to_e8m0``), ``scale_inv = 2^(e - 127)`` and
``x_fp8 = saturate_cast(x * (1 if e == 0 else 2^(127 - e)))``.

The GEMMs, in the Dense form of `jax_fp8.gemm.scaled_dot` (every operand blocked along the axis
its GEMM contracts, so each tensor is quantized twice, each time from the high-precision
tensor, as block scaling's 1-D blocks are):

  forward  out = x . w:    x [M, K] and w^T [N, K], blocks along K
  dgrad    dx = g . w^T:   g [M, N] and w [K, N], blocks along N
  wgrad    dw = x^T . g:   x^T [K, M] and g^T [N, M], blocks along M

Each is ``sum_k deq(a)[m, k] * deq(b)[n, k]`` with float32 accumulation: natively through
``jax.nn.scaled_matmul`` (cuDNN) where every GPU of the process multiplies MXFP8 (Blackwell,
SM >= 10.0, cuDNN >= 9.7), elsewhere emulated with the same numbers (each operand
dequantized per block, one float32 dot). `jax_fp8.devtools.explain` says which.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import _registration, recipe as recipe_lib
from jax_fp8._primitives import axis_types
from jax_fp8._primitives.exact import U32, abs_bits, cast_scaled, from_bits, up_scaled, widen
from jax_fp8._primitives.quotient import product_bits
from jax_fp8.gemm import _grouped
from jax_fp8.gemm.scaled_dot import StatelessRecipe, Types, explicit_type, typed
from jax_fp8.quantization import current
from jax_fp8.recipe import Format

__all__ = ["MXFP8BlockScaling", "dequantize_mxfp8", "native_status", "quantize_mxfp8"]

BLOCK = 32
E8M0 = np.dtype(jnp.float8_e8m0fnu)
_F32 = np.float32
# The name scope of an emulated MXFP8 GEMM (what jax_fp8.devtools.explain reads).
EMULATED_SCOPE = "mxfp8_emulated"


@recipe_lib.register
@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(StatelessRecipe):
    """MXFP8 block scaling: one E8M0 scale per 1 x 32 block along each GEMM's contraction
    axis, from the block's own amax (Transformer Engine's ``MXFP8BlockScaling``). No state
    is kept.

    Attributes:
      fp8_format: Format.E4M3 (the default, E4M3 everywhere, TE's choice) or
        Format.HYBRID (E5M2 gradients).
    """

    keeps_state: ClassVar[bool] = False
    # No measured break-even yet: block scaling's (the same casts and amaxes per block).
    auto_min_fp8_flops: ClassVar[float] = 2.0 ** 37

    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")

    def matmul_forward(self, x: jax.Array, w: jax.Array, out_dtype: DTypeLike, keep: bool,
                       ) -> tuple[jax.Array, tuple[Any, ...] | None]:
        fwd = self.fp8_format.fwd_dtype
        qx, sx = quantize_mxfp8(x, fwd)                    # [M, K], blocks along K
        qw, sw = quantize_mxfp8(w.T, fwd)                  # [N, K]
        out = _gemm(qx, sx, qw, sw, out_dtype)
        if not keep:
            return out, None
        qx_t, sx_t = quantize_mxfp8(x.T, fwd)              # [K, M], blocks along M
        qw_kn, sw_kn = quantize_mxfp8(w, fwd)              # [K, N], blocks along N
        return out, (qx_t, sx_t, qw_kn, sw_kn, Types(explicit_type(x), explicit_type(w)))

    def matmul_backward(self, residuals: tuple[Any, ...], g: jax.Array, x_dtype: DTypeLike,
                        w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        qx_t, sx_t, qw_kn, sw_kn, types = residuals
        bwd = self.fp8_format.bwd_dtype
        qg, sg = quantize_mxfp8(g, bwd)                    # [M, N], blocks along N
        qg_t, sg_t = quantize_mxfp8(g.T, bwd)              # [N, M], blocks along M
        dx = _gemm(qg, sg, qw_kn, sw_kn, x_dtype)          # [M, N] . [K, N]^T
        dw = _gemm(qx_t, sx_t, qg_t, sg_t, w_dtype)        # [K, M] . [N, M]^T
        return typed(dx, types.x), typed(dw, types.w)

    # ----------------------------------------------- grouped GEMMs (fp8_ragged_dot)
    # Every operand in 1 x 32 blocks along its GEMM's contraction: the input's and the
    # gradient's along K (N) within a row, each expert's weight its own; the weight
    # gradient's along the tokens, cut at group boundaries (_grouped).

    def ragged_forward(self, x: jax.Array, w: jax.Array, ends: jax.Array, out_dtype: DTypeLike,
                       keep: bool) -> tuple[jax.Array, Any]:
        return _grouped.blocked_forward(_BLOCKS, self.fp8_format.fwd_dtype, x, w, ends,
                                        out_dtype, keep)

    def ragged_backward(self, residuals: Any, g: jax.Array, ends: jax.Array, x_dtype: DTypeLike,
                        w_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
        return _grouped.blocked_backward(_BLOCKS, self.fp8_format.bwd_dtype, residuals, g,
                                         ends, x_dtype, w_dtype)


def _elements(x32: jax.Array, amax: jax.Array, fp8_dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """x32 quantized with the E8M0 scale of a block whose amax is `amax` (broadcast), as
    `quantize_mxfp8` quantizes each value: (q, scale_inv float8_e8m0fnu)."""
    x32, amax = jnp.broadcast_arrays(x32, amax)
    e = _e8m0(amax, fp8_dtype)
    pre, factor = _scale(e)
    nan = (lax.bitcast_convert_type(x32, jnp.uint32) & U32(0x7FFFFFFF)) > U32(0x7F800000)
    xs = jnp.where(pre & ~nan, x32 * _F32(2.0 ** -64), x32)
    return (cast_scaled(xs, factor, fp8_dtype),
            lax.bitcast_convert_type(e.astype(jnp.uint8), E8M0))


def _dequantize_elements(q: jax.Array, scale_inv: jax.Array) -> jax.Array:
    """q * scale_inv elementwise (scale_inv E8M0), as `dequantize_mxfp8`."""
    e = lax.bitcast_convert_type(scale_inv, jnp.uint8).astype(jnp.uint32)
    s = from_bits(jnp.where(e == 255, U32(0x7FC00000),
                            jnp.where(e == 0, U32(0x400000), e << 23)))
    return q.astype(jnp.float32) * s


# ----------------------------------------------------------------------------- quantize

def _e8m0(amax: jax.Array, fp8_dtype: DTypeLike) -> jax.Array:
    """The E8M0 exponent (uint32, 0..255) of each block amax (float32 >= 0, NaN-free)."""
    rcp = _F32(1) / _F32(recipe_lib.fp8_max(fp8_dtype))      # TE's max_norm_rcp
    up, down = up_scaled(amax)   # a subnormal amax as a normal value times 2**-64
    v = product_bits(up, rcp, down)                          # IEEE float32 amax * rcp
    be, man = v >> 23, v & U32(0x7FFFFF)
    round_up = (man != 0) & (be != 254) & ~((be == 0) & (man <= 0x400000))
    e = be + round_up.astype(jnp.uint32)
    inf = U32(0x7F800000)
    return jnp.where(v > inf, U32(255), jnp.where(v == inf, U32(254), jnp.where(
        v == 0, U32(0), e)))


def _scale(e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x's factor 1 (e == 0) or 2**(127 - e), as (pre, factor): x * pre * factor with
    both normal (2**(127 - e) < 2**-63 taken as 2**-64 times a normal power of two)."""
    pre = e > 190
    e = e.astype(jnp.int32)
    k = jnp.where(e == 0, 0, jnp.where(pre, 191 - e, 127 - e))
    return pre, from_bits(((k + 127).astype(jnp.uint32)) << 23)


def quantize_mxfp8(x: ArrayLike, fp8_dtype: DTypeLike = jnp.float8_e4m3fn,
                   ) -> tuple[jax.Array, jax.Array]:
    """MXFP8 quantization of x laid out as ``[..., M, K]`` (K the contraction axis).

    Shapes: x [..., M, K] (float32/bfloat16/float16) -> (x_fp8 [..., M, K],
    scale_inv float8_e8m0fnu [..., M, ceil(K / 32)]): one E8M0 scale per 32 consecutive
    values along K (the last block of a row holds K mod 32 when K is not a multiple of 32),
    computed as docs/semantics.md ("MXFP8") says, bit for bit. ``x ~= x_fp8 * scale_inv``
    broadcast over each block. Not differentiated (a zero gradient).

    Example:

        q, s = jax_fp8.quantize_mxfp8(x)          # x [4096, 1024] -> s [4096, 32] (E8M0)
    """
    x = current._operand(x)
    fp8_dtype = recipe_lib.canonical_fp8_dtype(fp8_dtype)
    x = lax.stop_gradient(x)
    with jax.disable_jit(False):  # one compiled program also when eager
        if not axis_types.on_explicit_mesh(x):
            return _quantize(fp8_dtype)(x)
        # Explicit axes: the blocks split x's last axis, which may be sharded; XLA
        # partitions the computation, the results are typed as x (its scales replicated
        # along their last axis).
        spec = _spec(x)
        shardings = (_named(x, spec), _named(x, spec[:-1] + (None,)))
        return cast("tuple[jax.Array, jax.Array]",
                    jax.sharding.auto_axes(_quantize(fp8_dtype), out_sharding=shardings)(x))


def _spec(x: Any) -> tuple[Any, ...]:
    """x's PartitionSpec as a tuple of one entry per axis."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return cast("tuple[Any, ...]", spec + (None,) * (x.ndim - len(spec)))


def _named(x: Any, spec: Sequence[Any]) -> jax.sharding.NamedSharding:
    # PartitionSpec's constructor is unannotated in JAX.
    return cast(jax.sharding.NamedSharding,
                jax.typeof(x).sharding.update(spec=jax.sharding.PartitionSpec(*spec)))  # type: ignore[no-untyped-call]


@functools.cache
def _quantize(fp8_dtype: np.dtype) -> Callable[..., tuple[jax.Array, jax.Array]]:
    @jax.jit
    def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        *lead, m, k = x.shape
        kb = -(-k // BLOCK)
        pad = [(0, 0)] * len(lead) + [(0, 0), (0, kb * BLOCK - k)]
        xp = jnp.pad(widen(x), pad).reshape(tuple(lead) + (m, kb, BLOCK))
        amax = from_bits(jnp.max(abs_bits(xp), axis=-1, initial=U32(0)))
        e = _e8m0(amax, fp8_dtype)
        pre, factor = _scale(e)
        pre, factor = pre[..., None], factor[..., None]
        nan = (lax.bitcast_convert_type(xp, jnp.uint32) & U32(0x7FFFFFFF)) > U32(0x7F800000)
        xs = jnp.where(pre & ~nan, xp * _F32(2.0 ** -64), xp)
        q = lax.bitcast_convert_type(cast_scaled(xs, factor, fp8_dtype), jnp.uint8)
        # The padding is cut off as bytes (XLA:CPU slices FP8 arrays through a float
        # conversion that rewrites every E5M2 NaN).
        q = q.reshape(tuple(lead) + (m, kb * BLOCK))[..., :k]
        return (lax.bitcast_convert_type(q, fp8_dtype),
                lax.bitcast_convert_type(e.astype(jnp.uint8), E8M0))

    return quantize


def dequantize_mxfp8(x_fp8: ArrayLike, scale_inv: ArrayLike) -> jax.Array:
    """``x_fp8 * scale_inv`` broadcast over each 1 x 32 block, in float32.

    Shapes: x_fp8 [..., M, K], scale_inv float8_e8m0fnu [..., M, ceil(K / 32)] -> [..., M, K].
    Products in the subnormal range read as zeros of their sign (XLA flushes them); an E8M0
    NaN (0xFF) gives NaN."""
    x_fp8, scale_inv = jnp.asarray(x_fp8), jnp.asarray(scale_inv)
    want = x_fp8.shape[:-1] + (-(-x_fp8.shape[-1] // BLOCK),)
    if x_fp8.ndim < 2 or scale_inv.shape != want or np.dtype(scale_inv.dtype) != E8M0:
        raise ValueError(f"scale_inv must be float8_e8m0fnu{list(want)} for x_fp8 "
                         f"{x_fp8.shape}, got {scale_inv.dtype}{list(scale_inv.shape)}")
    *lead, m, k = x_fp8.shape
    kb = want[-1]
    e = lax.bitcast_convert_type(scale_inv, jnp.uint8).astype(jnp.uint32)
    s = from_bits(jnp.where(e == 255, U32(0x7FC00000),
                            jnp.where(e == 0, U32(0x400000), e << 23)))
    pad = [(0, 0)] * len(lead) + [(0, 0), (0, kb * BLOCK - k)]
    x = jnp.pad(x_fp8.astype(jnp.float32), pad).reshape(tuple(lead) + (m, kb, BLOCK))
    return (x * s[..., None]).reshape(tuple(lead) + (m, kb * BLOCK))[..., :k]


# --------------------------------------------------------------------------------- GEMM

@functools.cache
def native_status() -> tuple[bool, str]:
    """(whether this process multiplies MXFP8 natively, why or why not): every local GPU
    Blackwell or later (SM >= 10.0); the cuDNN that jax >= 0.10's CUDA wheels require
    (>= 9.8) has the MXFP8 GEMM. Probed once."""
    caps = _registration.local_gpu_capabilities()
    if not caps:
        return False, "no GPU in this process"
    if not all(c.split(".")[0].isdigit() and int(c.split(".")[0]) >= 10 for c in caps):
        return False, f"MXFP8 GEMMs need Blackwell GPUs (SM >= 10.0), found SM {caps}"
    return True, f"SM {caps}"


def _gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array,
          out_dtype: DTypeLike) -> jax.Array:
    """a [M, K] . b [N, K]^T with their 1 x 32 E8M0 block scales, in out_dtype."""
    if axis_types.on_explicit_mesh(a):
        # Explicit axes: XLA partitions the GEMM; the product is typed with a's rows and
        # b's rows as its columns (a mesh axis sharding both is dropped from the columns).
        rows, cols = _spec(a)[0], _spec(b)[0]
        names: Callable[[Any], set[Any]] = \
            lambda s: set(s if isinstance(s, tuple) else (s,)) - {None}  # noqa: E731
        if names(rows) & names(cols):
            cols = None
        return cast(jax.Array, jax.sharding.auto_axes(
            lambda a, sa, b, sb: _local_gemm(a, sa, b, sb, out_dtype),
            out_sharding=_named(a, (rows, cols)))(a, sa, b, sb))
    return _local_gemm(a, sa, b, sb, out_dtype)


def _local_gemm(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array,
                out_dtype: DTypeLike) -> jax.Array:
    native, why = native_status()
    k = a.shape[-1]
    if native:
        pad = -(-k // BLOCK) * BLOCK - k    # zero bytes: their blocks' scales stay
        a, b = (jnp.pad(q, ((0, 0), (0, pad))) if pad else q for q in (a, b))
        out = jax.nn.scaled_matmul(a[None], b[None], sa[None], sb[None],
                                   preferred_element_type=jnp.float32)[0]
        return out.astype(out_dtype)
    with jax.named_scope(EMULATED_SCOPE):
        out = lax.dot_general(dequantize_mxfp8(a, sa), dequantize_mxfp8(b, sb),
                              (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


recipe_lib.GEMM_SCOPES[EMULATED_SCOPE] = (
    "mxfp8 emulated", lambda: (f"MXFP8 GEMM emulated ({native_status()[1]}): each operand "
                               f"dequantized per 1x32 block, one float32 dot"))
recipe_lib.GEMM_PRIMITIVES["scaled_matmul_wrapper"] = (
    "mxfp8", lambda: f"native MXFP8 GEMM (jax.nn.scaled_matmul, cuDNN; {native_status()[1]})")


_BLOCKS = _grouped.Blocks(
    block=BLOCK, quantize=lambda a, role, fp8_dtype: quantize_mxfp8(a, fp8_dtype),
    dequantize=lambda q, s, role: dequantize_mxfp8(q, s), elements=_elements,
    dequantize_elements=_dequantize_elements)
