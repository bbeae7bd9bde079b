"""An independent NumPy float32 implementation of docs/semantics.md, the bit-exact reference.

Nothing here imports jax_fp8: the numbers come straight from docs/semantics.md. NumPy's
float32 arithmetic runs on the host's IEEE hardware without flush-to-zero (the
default MXCSR / FPCR state of a Python process), so subnormal inputs and results
are kept exactly as docs/semantics.md asks. `assert_no_ftz()` checks that at import time.

Every function works on whole arrays: a history [..., L] holds independent tensors
on its leading axes, so the tests feed thousands of cases in one call.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
FLT_MIN = F32(np.finfo(np.float32).tiny)  # smallest normal
POW2_MASK = np.uint32(0xFF800000)

# the contract's (docs/semantics.md) fp8_max table, written out (not taken from ml_dtypes or
# jax_fp8).
FP8_MAX = {
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2fnuz": 57344.0,
}


def assert_no_ftz() -> None:
    """NumPy must keep subnormals, or this module is no reference."""
    tiny = np.array([1e-45], np.float32)
    one_over_max = F32(1.0) / np.array([FLT_MAX], np.float32)
    assert one_over_max.view(np.uint32)[0] == 0x00200000, "flush-to-zero is on"
    assert (tiny * F32(2.0)).view(np.uint32)[0] == 2, "flush-to-zero is on"
    assert (np.array([1e-40], np.float32) > F32(0))[0], "denormals-are-zero is on"


assert_no_ftz()


def fp8_max(fp8_dtype) -> float:
    name = fp8_dtype if isinstance(fp8_dtype, str) else np.dtype(fp8_dtype).name
    return FP8_MAX[name]


def scaled_max(fp8_dtype, margin) -> np.float32:
    """float32(fp8_max) * float32(2 ** -margin), in float32."""
    with np.errstate(all="ignore"):
        return F32(fp8_max(fp8_dtype)) * F32(2.0 ** -float(margin))


def bits(x) -> np.ndarray:
    return np.array(x, np.float32, copy=True).view(np.uint32)  # keeps 0-d shapes


def is_subnormal(x) -> np.ndarray:
    b = bits(x) & np.uint32(0x7FFFFFFF)
    return (b != 0) & (b < np.uint32(0x00800000))


def fmax_num(a, b) -> np.ndarray:
    """IEEE 754-2019 maximumNumber on float32: a NaN operand is ignored (NaN only if
    both are), +0 > -0; otherwise the larger. Returns one of the operands' bits."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    a, b = np.broadcast_arrays(a, b)
    with np.errstate(invalid="ignore"):
        a_nan, b_nan = np.isnan(a), np.isnan(b)
        # Where equal (+0 vs -0 included), the one without a sign bit wins.
        pick_a = (a > b) | ((a == b) & ~np.signbit(a))
    out = np.where(pick_a, a, b)
    out = np.where(b_nan, a, out)
    out = np.where(a_nan, b, out)
    return out.astype(np.float32, copy=False)


def update(history, scale, amax=None, *, fp8_dtype="float8_e4m3fn", margin=0.0,
           amax_compute_algo="max", power_of_2_scale=False, skip_unused=False, smax=None):
    """the contract's (docs/semantics.md) update of history [..., L], scale [...], amax [...] or
    None.

    Returns (history', scale', scale_inv') as new float32 arrays; inputs untouched.
    `smax` overrides scaled_max(fp8_dtype, margin) (for per-tensor maxima).
    """
    h = np.array(history, np.float32, copy=True)
    s_prev = np.array(scale, np.float32, copy=True)
    if h.ndim < 1 or h.shape[-1] < 1:
        raise ValueError("history needs a last axis of length >= 1")
    if s_prev.shape != h.shape[:-1]:
        raise ValueError("scale must have history.shape[:-1]")
    L = h.shape[-1]
    if smax is None:
        smax = scaled_max(fp8_dtype, margin)
    smax = np.asarray(smax, np.float32)
    with np.errstate(all="ignore"):
        h0 = h[..., 0].copy()
        if amax is not None:
            amax = np.asarray(amax, np.float32)
            if amax.shape != s_prev.shape:
                raise ValueError("amax must have history.shape[:-1]")
            h0 = fmax_num(h0, amax)

        if amax_compute_algo == "max":
            a = fmax_num(np.zeros_like(h0), h0)  # fmaxf(0, h0, h[1], ..., h[L-1])
            for j in range(1, L):
                a = fmax_num(a, h[..., j])
        elif amax_compute_algo == "most_recent":
            a = h0
        else:
            raise ValueError(amax_compute_algo)

        usable = np.isfinite(a) & (a > F32(0))
        s = np.where(usable, (smax / np.where(usable, a, F32(1))).astype(np.float32), s_prev)
        s = np.where(np.isinf(s), FLT_MAX, s).astype(np.float32)
        if power_of_2_scale:
            s = (bits(s) & POW2_MASK).view(np.float32)
        s_inv = (F32(1.0) / s).astype(np.float32)

        new_h = np.zeros_like(h)
        if L > 1:
            new_h[..., 1:L - 1] = h[..., 2:]
            new_h[..., L - 1] = h0

        if skip_unused:
            unused = h0 == F32(0)  # +0 and -0; never NaN
            new_h = np.where(unused[..., None], h, new_h)
            s = np.where(unused, s_prev, s)
            s_inv = np.where(unused, (F32(1.0) / s_prev).astype(np.float32), s_inv)
    return (np.asarray(new_h, np.float32), np.asarray(s, np.float32).reshape(s_prev.shape),
            np.asarray(s_inv, np.float32).reshape(s_prev.shape))
