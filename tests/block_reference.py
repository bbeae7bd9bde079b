"""An independent NumPy oracle of the contract's current and blockwise scaling (no jax_fp8 import).

NumPy's float32 arithmetic is IEEE with subnormals (tests/ieee_reference.py checks the
process has no flush-to-zero), and ml_dtypes casts float32 to FP8 with round-to-nearest-even.
Written straight from the contract (docs/semantics.md, "Current and blockwise scaling"):

    amax of a block = fmaxf(0, |x_1|, ..., |x_n|)       (NaN ignored)
    amax < eps -> eps; amax 0, inf or NaN -> s = 1, else s = fp8_max / amax; inf s -> FLT_MAX
    power_of_2_scale: bits(s) & 0xFF800000;  scale_inv = 1 / s
    x_fp8 = saturate_cast(x * s): clip to +-fp8_max in float32, NaN stays NaN
            (the byte is the type's quiet NaN 0x7F / 0x7E with x's sign), round to nearest even
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
U32 = np.uint32
FLT_MAX = F32(np.finfo(np.float32).max)
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "float8_e4m3fnuz": 240.0,
           "float8_e5m2fnuz": 57344.0}
FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
       "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz}


def _name(fp8_dtype) -> str:
    return np.dtype(fp8_dtype).name


def scale_from_amax(amax, fp8_dtype, power_of_2_scale=False, amax_epsilon=0.0):
    """(s, scale_inv) elementwise, float32."""
    a = np.array(amax, np.float32, copy=True)
    eps = F32(amax_epsilon)
    with np.errstate(all="ignore"):
        a = np.where(a < eps, eps, a).astype(np.float32)
        s = (F32(FP8_MAX[_name(fp8_dtype)]) / a).astype(np.float32)
        s = np.where(np.isinf(a) | np.isnan(a) | (a == 0), F32(1), s).astype(np.float32)
        s = np.where(np.isinf(s), FLT_MAX, s).astype(np.float32)
        if power_of_2_scale:
            s = (s.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
        return s, (F32(1) / s).astype(np.float32)


def cast(x, s, fp8_dtype):
    """saturate_cast(float32(x) * s) (x and s broadcast) as FP8."""
    name = _name(fp8_dtype)
    x = np.asarray(x).astype(np.float32)
    fmax = F32(FP8_MAX[name])
    with np.errstate(all="ignore"):
        y = np.clip((x * s).astype(np.float32), -fmax, fmax)
    q = y.astype(FP8[name]).view(np.uint8)
    nan = np.isnan(x)
    if name.endswith("fnuz"):
        q = np.where(nan, np.uint8(0x80), q)
    else:
        sign = (x.view(np.uint32) >> 24).astype(np.uint8) & np.uint8(0x80)
        q = np.where(nan, sign | np.uint8(0x7E if name == "float8_e5m2" else 0x7F), q)
    return q.astype(np.uint8).view(FP8[name])


def block_amax(x, bm, bk=128):
    """x [..., M, K] -> [..., ceil(M/bm), ceil(K/bk)]: fmaxf from 0 over each block (the
    edge blocks padded with zeros, which change no max from 0)."""
    x = np.abs(np.asarray(x).astype(np.float32))
    # fmaxf from 0 ignores NaN: the same as a max with NaN read as 0. (np.fmax.reduce is
    # not used: NumPy 2.4 reduces a non-contiguous array holding NaNs to a wrong value.)
    x = np.where(np.isnan(x), F32(0), x)
    *lead, m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    x = np.pad(x, [(0, 0)] * len(lead) + [(0, mb * bm - m), (0, kb * bk - k)])
    x = x.reshape(tuple(lead) + (mb, bm, kb, bk))
    return np.max(x, axis=(-1, -3), initial=F32(0))


def quantize_blocks(x, block_shape, fp8_dtype, power_of_2_scale=True, amax_epsilon=0.0):
    """x [..., M, K] -> (x_fp8 [..., M, K], scale_inv [..., ceil(M/bm), ceil(K/bk)])."""
    bm, bk = block_shape
    x = np.asarray(x)
    s, s_inv = scale_from_amax(block_amax(x, bm, bk), fp8_dtype, power_of_2_scale, amax_epsilon)
    m, k = x.shape[-2:]
    full = np.repeat(np.repeat(s, bm, axis=-2), bk, axis=-1)[..., :m, :k]
    return cast(x, full, fp8_dtype), s_inv


def quantize_current(x, fp8_dtype, power_of_2_scale=False, amax_epsilon=0.0):
    """Per tensor: (x_fp8, scale_inv []) with amax = max |x| (NaN propagating)."""
    x = np.asarray(x).astype(np.float32)
    amax = np.max(np.abs(x)) if x.size else F32(0)
    s, s_inv = scale_from_amax(amax, fp8_dtype, power_of_2_scale, amax_epsilon)
    return cast(x, s, fp8_dtype), s_inv


def dequantize_blocks(q, scale_inv, block_shape):
    """q [..., M, K] * scale_inv broadcast over blocks, in float64 (exact for these)."""
    bm, bk = block_shape
    m, k = q.shape[-2:]
    full = np.repeat(np.repeat(np.asarray(scale_inv, np.float64), bm, -2), bk, -1)[..., :m, :k]
    return np.asarray(q).astype(np.float64) * full


def mxfp8_e8m0(amax, fp8_dtype):
    """SPEC's rule on float32 bits, with NumPy's IEEE float32 (subnormals kept)."""
    fp8_max = F32(FP8_MAX[_name(fp8_dtype)])
    with np.errstate(all="ignore"):
        v = (amax.astype(F32) * (F32(1) / F32(fp8_max))).astype(F32)
    b = v.view(U32)
    be, man = b >> U32(23), b & U32(0x7FFFFF)
    up = (man != 0) & (be != 254) & ~((be == 0) & (man <= 0x400000))
    e = np.where(np.isnan(v), 255, np.where(np.isinf(v), 254,
                                            np.where(v == 0, 0, be + up.astype(U32))))
    return e.astype(np.uint8)


def quantize_mxfp8(x, fp8_dtype):
    """MXFP8 (docs/semantics.md): x [..., M, K] -> (q, the E8M0 exponents as uint8
    [..., M, ceil(K/32)])."""
    x = np.asarray(x).astype(F32)
    k = x.shape[-1]
    e = mxfp8_e8m0(block_amax(x, 1, 32), fp8_dtype).astype(np.int32)
    factor = np.where(e == 0, F32(1), np.ldexp(F32(1), 127 - e).astype(F32)).astype(F32)
    q = cast(x, np.repeat(factor, 32, -1)[..., :k], fp8_dtype)
    return q, e.astype(np.uint8)
