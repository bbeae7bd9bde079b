"""An independent NumPy oracle of SPEC's "Grouped GEMMs" (no jax_fp8 import): G GEMMs, each
with the FP8 tensors a GEMM has, written per group from the contract and the quantizers of
tests/block_reference.py.

Groups: sizes clamped in order (negative -> 0, a group past row M cut there); rows past the
last group are 0 in the output and take part in no gradient.

Per-group recipes (delayed, current): group g's rows quantized with scale s_x[g] (the
gradient's with s_g[g]), expert g's weight with s_w[g]; each GEMM's float32 sum times
(scale_inv_a[g] * scale_inv_b[g]) in float32, rounded once to the result dtype.
Blocked recipes (block, MXFP8): each operand quantized per block (the input's and the
gradient's rows along their contraction, each expert's weight on its own, the weight
gradient's operands along the tokens of each group alone) and the float32 sum of the
dequantized products, rounded once.

The sums are taken in float64 and rounded to float32: exact for the operands the tests use
(tests/moe/test_ragged_dot.py, `exact_operands`), so any summation order gives these bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import block_reference as br

F32 = np.float32
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)


def bounds(sizes, m):
    """[(start, end)] of each group, clamped in order."""
    out, start = [], 0
    for s in np.asarray(sizes):
        size = int(min(max(int(s), 0), m - start))
        out.append((start, start + size))
        start += size
    return out


def matmul_f32(a, b):
    """a @ b summed in float64 and rounded to float32 (exact for the tests' operands)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).astype(F32)


def group_amax(x, bnds):
    """max |x| over each group's rows (NaN propagating, 0 when empty), float32 [G]."""
    x = np.abs(np.asarray(x).astype(F32))
    return np.array([np.max(x[s:e]) if e > s else F32(0) for s, e in bnds], F32)


def expert_amax(w):
    w = np.abs(np.asarray(w).astype(F32))
    return np.array([np.max(w[g]) for g in range(w.shape[0])], F32)


def inv(s):
    with np.errstate(all="ignore"):
        return (F32(1) / np.asarray(s, F32)).astype(F32)


class PerGroup:
    """Delayed (scales given) or current scaling (scales from each group's amax)."""

    def __init__(self, fwd, bwd, scales=None, power_of_2_scale=False, amax_epsilon=0.0):
        self.fwd, self.bwd, self.scales = fwd, bwd, scales
        self.pow2, self.eps = power_of_2_scale, amax_epsilon

    def _scale(self, role, amax, dtype):
        if self.scales is not None:       # delayed: the states' scales
            return np.asarray(self.scales[role], F32)
        return br.scale_from_amax(amax, dtype, self.pow2, self.eps)[0]

    def _rows(self, x, bnds, role, dtype):
        s = self._scale(role, group_amax(x, bnds), dtype)
        q = np.zeros(x.shape, F32)
        for g, (a, b) in enumerate(bnds):
            q[a:b] = br.cast(np.asarray(x[a:b]).astype(F32), s[g], dtype).astype(F32)
        return q, inv(s)

    def forward(self, x, w, sizes, out_dtype):
        bnds = bounds(sizes, x.shape[0])
        qx, sx = self._rows(x, bnds, "input", self.fwd)
        sw_q = self._scale("kernel", expert_amax(w), self.fwd)
        qw = np.stack([br.cast(np.asarray(w[g]).astype(F32), sw_q[g], self.fwd).astype(F32)
                       for g in range(w.shape[0])])
        sw = inv(sw_q)
        out = np.zeros((x.shape[0], w.shape[2]), F32)
        with np.errstate(invalid="ignore", over="ignore"):
            for g, (a, b) in enumerate(bnds):
                out[a:b] = matmul_f32(qx[a:b], qw[g]) * (sx[g] * sw[g])
        return out.astype(out_dtype), (qx, sx, qw, sw, bnds)

    def backward(self, res, ct, x_dtype, w_dtype):
        qx, sx, qw, sw, bnds = res
        qg, sg = self._rows(ct, bnds, "grad", self.bwd)
        dx = np.zeros(qx.shape, F32)
        dw = np.zeros(qw.shape, F32)
        with np.errstate(invalid="ignore", over="ignore"):
            for g, (a, b) in enumerate(bnds):
                dx[a:b] = matmul_f32(qg[a:b], qw[g].T) * (sg[g] * sw[g])
                dw[g] = matmul_f32(qx[a:b].T, qg[a:b]) * (sx[g] * sg[g])
        return dx.astype(x_dtype), dw.astype(w_dtype)


class Blocked:
    """Block scaling (1 x 128 rows, 128 x 128 weight tiles) or MXFP8 (1 x 32 everywhere)."""

    def __init__(self, fwd, bwd, mxfp8=False, w_tiles=True, power_of_2_scale=True):
        self.fwd, self.bwd, self.mxfp8 = fwd, bwd, mxfp8
        self.w_tiles, self.pow2 = w_tiles, power_of_2_scale

    def deq(self, x, dtype, tile=False):
        """x [..., R, C] quantized in blocks along C (or 128 x 128 tiles) and dequantized
        in float32 (the product of a value and its block's scale_inv: an infinite value's
        MXFP8 block, scale_inv 2**127, dequantizes 448 to inf)."""
        x = np.asarray(x).astype(F32)
        if self.mxfp8:
            q, e = br.quantize_mxfp8(x, dtype)
            scale_inv = np.ldexp(1.0, e.astype(np.int64) - 127)
            with np.errstate(over="ignore"):
                return br.dequantize_blocks(q, scale_inv, (1, 32)).astype(F32)
        shape = (128, 128) if tile else (1, 128)
        q, s = br.quantize_blocks(x, shape, dtype, self.pow2)
        return br.dequantize_blocks(q, s, shape).astype(F32)

    def forward(self, x, w, sizes, out_dtype):
        bnds = bounds(sizes, x.shape[0])
        dx_ = self.deq(x, self.fwd)                                         # along K
        dw_t = np.stack([self.deq(np.asarray(w[g]).T, self.fwd, self.w_tiles)
                         for g in range(w.shape[0])])                      # [G, N, K]
        out = np.zeros((x.shape[0], w.shape[2]), F32)
        for g, (a, b) in enumerate(bnds):
            out[a:b] = matmul_f32(dx_[a:b], dw_t[g].T)
        return out.astype(out_dtype), (np.asarray(x).astype(F32), np.asarray(w).astype(F32),
                                       bnds)

    def backward(self, res, ct, x_dtype, w_dtype):
        x, w, bnds = res
        ct = np.asarray(ct).astype(F32)
        dg = self.deq(ct, self.bwd)                                         # along N
        dx = np.zeros(x.shape, F32)
        dw = np.zeros(w.shape, F32)
        for g, (a, b) in enumerate(bnds):
            w_kn = self.deq(w[g], self.fwd, self.w_tiles)                   # [K, N]
            dx[a:b] = matmul_f32(dg[a:b], w_kn.T)
            if b > a:   # token-axis blocks of this group alone
                xt = self.deq(x[a:b].T, self.fwd)                          # [K, size]
                gt = self.deq(ct[a:b].T, self.bwd)                         # [N, size]
                dw[g] = matmul_f32(xt, gt.T)
        return dx.astype(x_dtype), dw.astype(w_dtype)
