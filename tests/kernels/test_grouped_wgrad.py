"""The grouped FP8 weight-gradient primitive (jax_fp8._primitives.grouped_wgrad): the kernel's
padded, transposed operands byte for byte; its reference against a NumPy statement of the
module's four steps, bit for bit; its argument checks; the CUDA kernel on unless switched off
(the decision explain reports, for one primitive and for a whole fp8_ragged_dot training
step lowered for CUDA); and, on a GPU with the CUDA module built with CUTLASS, the kernel
against the reference.

Bit-exact cases as in test_grouped_gemm.py: FP8 values whose products and partial sums are
exact in float32 (groups of at most 48 rows), so every summation order gives the same acc.

Bound for random operands on the GPU: test_grouped_gemm.py's, derived the same way with the
contraction length of group g's GEMM, its m_g tokens (the kernel sums each 128 tokens in
the tensor cores, then into a float32 accumulator):
  |out - E| <= (2**-10 + (m_g/128 + 4) u) S (1 + u_out) + u_out |E|,   u = 2**-24.
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import test_grouped_gemm as tgg
from jax_fp8 import _registration
from jax_fp8._primitives import base, grouped_gemm as gg, grouped_wgrad as gw
from jax_fp8.devtools import explain
from test_grouped_gemm import exact_values, integer_values, scales

F32 = np.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TARGET = 'custom_call_target="jax_fp8_grouped_wgrad"'
OUT_TYPES = (jnp.bfloat16, np.float16, np.float32)
NOT_BUILT = "the cuda kernel is not built in this process"


def clamp(sizes, m):
    """The sizes clamped in order (the grouped GEMM primitive's rule), as Python ints."""
    out, start = [], 0
    for size in np.asarray(sizes):
        size = int(min(max(int(size), 0), m - start))
        out.append(size)
        start += size
    return out


# ----------------------------------------------------------------------------- the oracle

def oracle(lhs, grad, sizes, ls, gs, out_dtype):
    """The module's steps 1-4 in NumPy: float64 sums over each group's rows (exact for the
    operands used with it) rounded to float32, alpha and acc * alpha in float32, one
    rounding to out_dtype; an empty group's out is 0 * alpha."""
    m, k, n = lhs.shape[0], lhs.shape[1], grad.shape[1]
    a = np.asarray(lhs).astype(np.float64)
    b = np.asarray(grad).astype(np.float64)
    out = np.zeros((len(sizes), k, n), np.float32)
    start = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for g, size in enumerate(clamp(sizes, m)):
            acc = (a[start:start + size].T @ b[start:start + size]).astype(np.float32)
            out[g] = acc * (np.float32(ls[g]) * np.float32(gs[g]))
            start += size
        return out.astype(out_dtype)


call = functools.partial(tgg.call_primitive, gw.grouped_wgrad)


SIZES = {
    "uneven": (5, 0, 17, 1, 9),          # sum 32 < M = 40: rows 32..39 in no group
    "empty_first_last": (0, 20, 20, 0, 0),
    "all_empty": (0, 0, 0, 0, 0),
    "past_m": (30, 0, 30, 7, 2),          # group 2 cut at row 40, groups 3, 4 empty
    "negative": (10, -3, 12, -(2 ** 31), 2 ** 31 - 1),
    "aligned": (16, 0, 16, 0, 8),
}


# ------------------------------------------------------- the kernel's operand layout

def padded_oracle(x, sizes, mp):
    """x [M, C] -> [C, mp] in NumPy: group g's rows in columns from sum of ceil16 of the
    sizes before it, zeros elsewhere."""
    x8 = np.asarray(x).view(np.uint8)
    out = np.zeros((x8.shape[1], mp), np.uint8)
    start = col = 0
    for size in clamp(sizes, x8.shape[0]):
        out[:, col:col + size] = x8[start:start + size].T
        start += size
        col += -(-size // 16) * 16
    return out


@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("c", [24, 22], ids=["words", "bytes"])
def test_padded_transpose_layout(case, c):
    """pad_transpose (the kernel's operands): each group's rows transposed into columns
    starting on 16-column boundaries, every other byte 0, rows past the groups not copied,
    the last 16 columns 0; Mp = round16(M) + 16 (G + 1). Rows gathered as 32-bit words
    (C % 4 == 0) or as bytes."""
    rng = np.random.default_rng(len(case))
    m = 40
    sizes = SIZES[case]
    mp = gw.padded_columns(m, len(sizes))
    assert mp == 48 + 16 * 6 and mp % 16 == 0
    for dtype in (E4M3, E5M2):
        x = rng.integers(1, 120, (m, c)).astype(np.uint8).view(np.dtype(dtype))
        ends = gg.clamped_group_ends(jnp.asarray(sizes, jnp.int32), m)
        got = jax.jit(functools.partial(gw.pad_transpose, mp=mp))(x, ends)
        assert got.dtype == np.dtype(dtype) and got.shape == (c, mp)
        want = padded_oracle(x, sizes, mp)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want)
        assert (want[:, -16:] == 0).all()
        starts = np.asarray(gw.column_starts(ends))
        assert (starts % 16 == 0).all()


def test_padded_transpose_of_no_rows():
    ends = gg.clamped_group_ends(jnp.asarray([0, 3], jnp.int32), 0)
    got = gw.pad_transpose(np.zeros((0, 8), np.dtype(E4M3)), ends, gw.padded_columns(0, 2))
    assert got.shape == (8, 48)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.zeros((8, 48), np.uint8))


def test_padded_columns_bound_every_layout():
    """sum of ceil16(m_g) + 16 <= Mp for sizes summing to at most M (G groups): the groups'
    columns end before the last 16, whatever the sizes."""
    rng = np.random.default_rng(0)
    for m in (0, 1, 15, 16, 17, 1000):
        for g in (1, 2, 7, 128):
            worst = [min(1, m)] * g if m < 16 * g else [17] * min(g, m // 17)
            for sizes in [worst] + [rng.multinomial(m, np.ones(g) / g) for _ in range(20)]:
                used = sum(-(-int(s) // 16) * 16 for s in sizes)
                assert used + 16 <= gw.padded_columns(m, g), (m, g, sizes)


# ----------------------------------------------------------------------- the reference

@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("types", [(E4M3, E5M2), (E4M3, E4M3)], ids=["e4m3xe5m2", "e4m3xe4m3"])
@pytest.mark.parametrize("out_dtype", OUT_TYPES, ids=lambda d: np.dtype(d).name)
def test_reference_matches_numpy_bit_for_bit(case, types, out_dtype):
    rng = np.random.default_rng(len(case))
    m, k, n, g = 40, 24, 16, 5
    lhs = exact_values(rng, (m, k), types[0])
    grad = exact_values(rng, (m, n), types[1])
    ls, gs = scales(rng, g), scales(rng, g)
    out = call(lhs, grad, SIZES[case], ls, gs, out_dtype)
    assert out.dtype == np.dtype(out_dtype) and out.shape == (g, k, n)
    np.testing.assert_array_equal(out, oracle(lhs, grad, SIZES[case], ls, gs, out_dtype))


def nan_inf_case(values):
    """E4M3 lhs x E5M2 grad of `values` with a NaN (E4M3's) in group 1's rows, infinities
    (E5M2's) in group 0's (inf - inf in one column), an infinite scale of empty group 3, and
    NaN and inf in the rows past the groups."""
    rng = np.random.default_rng(7)
    m, k, n = 20, 16, 8
    lhs = values(rng, (m, k), E4M3)
    grad = values(rng, (m, n), E5M2)
    grad[1, 3] = np.inf                      # group 0
    grad[2, 5], grad[3, 5] = np.inf, -np.inf
    lhs[2, :], lhs[3, :] = 1, 1
    lhs[6, 2] = np.nan                       # group 1
    lhs[18, 0], grad[19, 1] = np.nan, np.inf   # past the groups
    sizes = (4, 5, 9, 0)                     # rows 18, 19 past the groups
    ls = np.array([1.0, 2.0, 0.5, np.inf], np.float32)
    gs = np.array([0.5, 1.0, 4.0, 1.0], np.float32)
    return lhs, grad, sizes, ls, gs


def test_reference_nan_and_inf():
    """IEEE infinities and NaNs, each in its own group's output; rows past the groups reach
    none; an empty group with an infinite scale is 0 * inf = NaN."""
    lhs, grad, sizes, ls, gs = nan_inf_case(exact_values)
    out = call(lhs, grad, sizes, ls, gs, np.float32)
    np.testing.assert_array_equal(out, oracle(lhs, grad, sizes, ls, gs, np.float32))
    assert np.isinf(out[0]).any() and np.isnan(out[0, :, 5]).all()
    assert np.isnan(out[1, 2]).all()
    assert np.isfinite(out[2]).all() and np.isnan(out[3]).all()


def test_reference_under_vmap_and_grad():
    """Batched (vmap of the reference) and differentiated w.r.t. the scales."""
    rng = np.random.default_rng(3)
    lhs = exact_values(rng, (2, 12, 16), E4M3)
    grad = exact_values(rng, (2, 12, 8), E5M2)
    sizes = np.array([[4, 0, 8], [1, 2, 3]], np.int32)
    ls, gs = scales(rng, 6).reshape(2, 3), scales(rng, 6).reshape(2, 3)
    tgg.assert_batched_and_scale_grad(gw.grouped_wgrad, oracle, lhs, grad, sizes, ls, gs)


# ------------------------------------------------------------------------ argument checks

def _avals(m=32, k=32, n=16, g=4, lhs=E4M3, grad=E5M2, sizes=np.int32, scale=np.float32):
    return (jax.ShapeDtypeStruct((m, k), lhs), jax.ShapeDtypeStruct((m, n), grad),
            jax.ShapeDtypeStruct((g,), sizes), jax.ShapeDtypeStruct((g,), scale),
            jax.ShapeDtypeStruct((g,), scale))


@pytest.mark.parametrize("args, error, match", [
    ((jax.ShapeDtypeStruct((2, 32, 32), E4M3),) + _avals()[1:], TypeError, "lhs \\[M, K\\]"),
    ((jax.ShapeDtypeStruct((32, 32), jnp.bfloat16),) + _avals()[1:], TypeError, "FP8"),
    (_avals()[:1] + (jax.ShapeDtypeStruct((31, 16), E5M2),) + _avals()[2:], ValueError,
     "share M"),
    (_avals(sizes=np.uint32), ValueError, "group_sizes must be int32\\[G\\]"),
    (_avals(scale=jnp.bfloat16), ValueError, "lhs_scale_inv must be float32\\[4\\]"),
    (_avals()[:4] + (jax.ShapeDtypeStruct((3,), np.float32),), ValueError,
     "grad_scale_inv must be float32\\[4\\]"),
])
def test_argument_checks(args, error, match):
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda *a: gw.grouped_wgrad(*a, out_dtype=jnp.bfloat16), *args)


def test_out_dtype_and_implementation_checks():
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        jax.eval_shape(lambda *a: gw.grouped_wgrad(*a, out_dtype=jnp.int32), *_avals())
    with pytest.raises(ValueError, match="implementation must be one of"):
        jax.eval_shape(lambda *a: gw.grouped_wgrad(*a, out_dtype=jnp.float32,
                                                   implementation="cutlass"), *_avals())


# ------------------------------------------------- the decision, on unless switched off

def _bound_params(implementation="auto"):
    jaxpr = jax.make_jaxpr(lambda *a: gw.grouped_wgrad(
        *a, out_dtype=jnp.bfloat16, implementation=implementation))(*_avals())
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is gw.grouped_wgrad_p]
    return eqn.params


def test_kernel_is_on_unless_switched_off():
    """Without JAX_FP8_GROUPED_WGRAD_KERNEL=0 at import the primitive is bound with the
    kernel asked for (explain's CUDA row then names the kernel, or why it cannot run here);
    implementation="jnp" runs the reference whatever the switch; a primitive bound with the
    kernel off gets the reference and says why, on one device and under a jit over 8."""
    assert gw.KERNEL_ON is (os.environ.get(gw.ENV, "1") == "1")
    assert _bound_params()["kernel"] is gw.KERNEL_ON
    assert _bound_params("cuda")["kernel"] is True
    assert _bound_params("jnp")["implementation"] == "jnp"
    assert gw._refuses(*_avals(), out_dtype=np.dtype(jnp.bfloat16), kernel=False) == \
        gw.OFF_REASON
    rows = explain.explain(lambda *a: gw.grouped_wgrad(*a, out_dtype=jnp.bfloat16),
                           *_avals(), platform="cuda")
    (row,) = [r for r in rows if r.name == gw.TARGET]
    ok, why = gw.kernel_status()
    if not _registration.has_kernel(gw.TARGET, "cuda"):
        assert (row.lowering, row.why) == (base.REFERENCE, NOT_BUILT)
    elif not gw.KERNEL_ON:
        assert (row.lowering, row.why) == (base.REFERENCE, gw.OFF_REASON)
    elif not ok:
        assert (row.lowering, row.why) == (base.REFERENCE, why)
    else:
        assert row.lowering == base.KERNEL, row
    # under a jit over 8 devices: the partitioned kernel where asked for, else XLA
    # partitions the reference
    off = (base.REFERENCE, "a jit over 8 devices; the partitioning rule does not take these "
                           "operands: XLA partitions the reference")
    on = (base.PARTITIONED, "a jit over 8 devices: each runs the ")
    for impl, want in (("auto", on if gw.KERNEL_ON else off), ("cuda", on)):
        rows = explain.explain(lambda *a: gw.grouped_wgrad(
            *a, out_dtype=jnp.bfloat16, implementation=impl),  # noqa: B023
            *_avals(), platform="cuda", num_devices=8)
        (row,) = [r for r in rows if r.name == gw.TARGET]
        assert row.lowering == want[0] and row.why.startswith(want[1]), row


def test_an_invalid_switch_is_refused_at_import():
    env = helpers.with_test_path(dict(os.environ, **{gw.ENV: "yes"}))
    proc = subprocess.run([sys.executable, "-c", "import jax_fp8"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "JAX_FP8_GROUPED_WGRAD_KERNEL must be one of ('0', '1'), got 'yes'" in proc.stderr


@pytest.mark.parametrize("m, k, n, g, lhs, grad, out, takes", [
    (64, 128, 256, 8, E4M3, E5M2, jnp.bfloat16, True),
    (64, 128, 256, 8, E4M3, E4M3, np.float32, True),
    (64, 128, 256, 8, E4M3, E5M2, np.float16, True),     # float32 from the kernel, converted
    (0, 128, 256, 8, E4M3, E5M2, jnp.bfloat16, True),     # every group empty: alpha * 0
    (64, 40, 256, 8, E4M3, E5M2, jnp.bfloat16, True),     # any K (CUTLASS's M)
    (37, 128, 256, 8, E4M3, E5M2, jnp.bfloat16, True),    # any M (padded)
    (64, 128, 260, 8, E4M3, E5M2, jnp.bfloat16, False),   # N % 8 (bf16 out)
    (64, 128, 260, 8, E4M3, E5M2, np.float32, True),      # N % 4 (f32 out)
    (64, 128, 258, 8, E4M3, E5M2, np.float32, False),
    (64, 128, 256, 8, E5M2, E5M2, jnp.bfloat16, False),   # E5M2 lhs: not compiled
    (64, 128, 256, 0, E4M3, E5M2, jnp.bfloat16, False),   # no groups
    (64, 0, 256, 8, E4M3, E5M2, jnp.bfloat16, False),     # nothing to compute
])
def test_kernel_limits(m, k, n, g, lhs, grad, out, takes):
    """ffi/grouped_wgrad_limits.h, asked of the built module."""
    if not hasattr(_registration.CPU_MODULE or _registration.CUDA_MODULE,
                   "grouped_wgrad_supports"):
        pytest.skip("the built module predates the grouped weight gradient")
    avals = _avals(m=m, k=k, n=n, g=g, lhs=lhs, grad=grad)
    assert gw.kernel_supports(avals[0], avals[1], g, out) is takes
    reason = gw._refuses(*avals, out_dtype=np.dtype(out), kernel=True)
    if not takes and gw.kernel_status()[0]:
        assert "does not take these operands" in reason


# -------------------------------------- a whole training step, lowered for CUDA

STEP_SCRIPT = r"""
import json, jax, jax.numpy as jnp, numpy as np
import jax_fp8
from jax_fp8._primitives import grouped_gemm as gg, grouped_wgrad as gw
from jax_fp8.devtools import explain
M, K, N, G = 64, 128, 32, 4
x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
w = jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16)
sizes = jnp.asarray([20, 0, 30, 10], jnp.int32)
out = {}
for name, recipe in (("delayed", jax_fp8.DelayedScaling(history_len=4)),
                     ("current", jax_fp8.Float8CurrentScaling())):
    meta = jax_fp8.Fp8Meta.create(recipe, shape=(G,))
    def step(x, w, meta):
        def loss(x, w, meta):
            y, _ = jax_fp8.fp8_ragged_dot(x, w, sizes, meta)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, meta)
    text = jax.jit(step).trace(x, w, meta).lower(lowering_platforms=("cuda",)).as_text()
    rows = explain.explain(step, x, w, meta, platform="cuda")
    out[name] = {
        "gemm_calls": text.count("stablehlo.custom_call @jax_fp8_grouped_gemm("),
        "wgrad_calls": text.count("stablehlo.custom_call @jax_fp8_grouped_wgrad("),
        "rows": [(r.name, r.lowering, r.why) for r in rows
                 if r.name in (gg.TARGET, gw.TARGET)],
    }
out["kernel_on"] = gw.KERNEL_ON
out["gemm_status"] = list(gg.kernel_status())
out["wgrad_status"] = list(gw.kernel_status())
print(json.dumps(out))
"""


def _lowered_step(switch):
    env = dict(os.environ)
    env.pop(gw.ENV, None)
    if switch is not None:
        env[gw.ENV] = switch
    proc = subprocess.run([sys.executable, "-c", STEP_SCRIPT], env=helpers.with_test_path(env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("switch", [None, "0"], ids=["default", "switched_off"])
def test_training_step_lowered_for_cuda(switch):
    """An fp8_ragged_dot training step (delayed and current scaling) lowered for CUDA: the
    forward and input gradient are grouped GEMM custom calls and the weight gradient a
    grouped weight-gradient custom call where the kernels are built for this machine and
    not switched off (one each per step); elsewhere explain's rows say why each runs its
    reference, and the program holds no custom call."""
    res = _lowered_step(switch)
    assert res["kernel_on"] is (switch != "0")
    gemm_ok, gemm_why = res["gemm_status"]
    wgrad_ok, wgrad_why = res["wgrad_status"]
    for name in ("delayed", "current"):
        r = res[name]
        gemm_rows = [row for row in r["rows"] if row[0] == gg.TARGET]
        wgrad_rows = [row for row in r["rows"] if row[0] == gw.TARGET]
        assert len(gemm_rows) == 2 and len(wgrad_rows) == 1, r["rows"]
        assert r["gemm_calls"] == (2 if gemm_ok else 0), r
        assert r["wgrad_calls"] == (1 if wgrad_ok and switch != "0" else 0), r
        if not gemm_ok:
            assert all(row[1:] == ["reference", gemm_why] or row[2] == NOT_BUILT
                       for row in gemm_rows), gemm_rows
        (row,) = wgrad_rows
        if switch == "0":
            assert row[1] == "reference"
            assert row[2] in (gw.OFF_REASON, NOT_BUILT)
        elif not wgrad_ok:
            assert row[1] == "reference" and row[2] in (wgrad_why, NOT_BUILT), row
        else:
            assert row[1] == "kernel", row


# ----------------------------------------------------------------------------------- GPU

def exact_bound(lhs, grad, sizes, ls, gs):
    """(E, S, m_g) in float64: E[g] = alpha_g lhs_g^T grad_g, S[g] = |alpha_g| |lhs_g|^T
    |grad_g|, and each group's contraction length."""
    m, k, n = lhs.shape[0], lhs.shape[1], grad.shape[1]
    a, b = np.asarray(lhs).astype(np.float64), np.asarray(grad).astype(np.float64)
    clamped = clamp(sizes, m)
    e, s = np.zeros((len(clamped), k, n)), np.zeros((len(clamped), k, n))
    start = 0
    for g, size in enumerate(clamped):
        alpha = float(np.float32(ls[g]) * np.float32(gs[g]))
        e[g] = alpha * (a[start:start + size].T @ b[start:start + size])
        s[g] = abs(alpha) * (np.abs(a[start:start + size]).T @ np.abs(b[start:start + size]))
        start += size
    return e, s, clamped


_gpu_hlo = functools.partial(tgg.gpu_hlo, gw.grouped_wgrad)
_gpu_run = functools.partial(tgg.gpu_run, gw.grouped_wgrad)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SIZES))
@pytest.mark.parametrize("grad_type", [E5M2, E4M3], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("out_dtype", OUT_TYPES, ids=lambda d: np.dtype(d).name)
def test_gpu_kernel_matches_reference_bit_for_bit(gpu_device, case, grad_type, out_dtype):
    """Exact sums (`integer_values`, groups of at most 40 rows): the kernel, the GPU reference
    and the NumPy oracle agree bit for bit: uneven, empty, all-empty and clamped groups, rows
    past the groups left out (every out[g] written: XLA does not pre-zero it)."""
    rng = np.random.default_rng(11 + len(case))
    m, k, n, g = 40, 24, 16, 5
    lhs = integer_values(rng, (m, k), E4M3)
    grad = integer_values(rng, (m, n), grad_type)
    ls, gs = scales(rng, g), scales(rng, g)
    ops = (lhs, grad, np.asarray(SIZES[case], np.int32), ls, gs)
    want = oracle(lhs, grad, SIZES[case], ls, gs, out_dtype)
    tgg.assert_kernel_and_reference_exact(gw.grouped_wgrad, gw.TARGET, gpu_device, ops,
                                          out_dtype, want)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, g, sizes", [
    (1000, 256, 512, 8, (100, 0, 300, 1, 127, 255, 0, 200)),     # sum 983: 17 rows past
    (4096, 2048, 768, 16, None),                                  # Qwen3-MoE-like per expert
    (333, 136, 96, 3, (0, 333, 0)),                               # one group, K not % 16
    (50, 64, 32, 4, (0, 0, 0, 0)),                                # all empty
])
@pytest.mark.parametrize("grad_type", [E5M2, E4M3], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, np.float32], ids=["bf16", "f32"])
def test_gpu_kernel_within_bound(gpu_device, m, k, n, g, sizes, grad_type, out_dtype):
    """Random operands over their whole range and random scales: the kernel within the
    module's bound of the float64 product (the contraction length of group g is m_g); an
    empty group's out exactly alpha_g * 0."""
    rng = np.random.default_rng(m + n + k)
    if sizes is None:
        cut = np.sort(rng.integers(0, m, g - 1))
        sizes = np.diff(np.concatenate([[0], cut, [m]]))
    lhs = (rng.standard_normal((m, k)) * 64).astype(np.dtype(E4M3))
    grad = (rng.standard_normal((m, n)) * 64).astype(np.dtype(grad_type))
    ls, gs = scales(rng, g) * F32(2.0 ** -8), scales(rng, g) * F32(2.0 ** -8)
    out = _gpu_run(gpu_device, lhs, grad, sizes, ls, gs, out_dtype, "cuda")
    e, s, lengths = exact_bound(lhs, grad, sizes, ls, gs)
    # each group's bound with its own contraction length m_g
    coef = tgg.kernel_coef(np.asarray(lengths))[:, None, None]
    tgg.assert_within(out, e, s, coef, out_dtype, f"{m}x{k}x{n} g={g}")
    for i, size in enumerate(lengths):
        if size == 0:
            assert (out[i] == 0).all()


@pytest.mark.gpu
def test_gpu_kernel_nan_and_inf(gpu_device):
    """The kernel on `nan_inf_case` (integer values elsewhere): the oracle's IEEE results,
    bit for bit, each NaN and infinity in its own group's output (NaNs compared as NaNs)."""
    lhs, grad, sizes, ls, gs = nan_inf_case(integer_values)
    ops = (lhs, grad, np.asarray(sizes, np.int32), ls, gs)
    assert TARGET in _gpu_hlo(gpu_device, *ops, out_dtype=np.float32)
    out = _gpu_run(gpu_device, *ops, np.float32, "cuda")
    np.testing.assert_array_equal(out, oracle(lhs, grad, sizes, ls, gs, np.float32))
    assert np.isfinite(out[2]).all() and np.isnan(out[3]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m, c, sizes", [
    (40, 24, SIZES["uneven"]),
    (40, 22, SIZES["past_m"]),                 # C % 4: bytes gathered, XLA's transpose
    (4096, 2048, (500, 0, 1200, 3, 2000, 393)),
    (1000, 768, (17,) * 50 + (0,) * 14),
])
def test_gpu_padded_transpose_layout(gpu_device, m, c, sizes):
    """The kernel's operands as its CUDA lowering builds them (rows gathered in XLA, the
    bytes transposed by ffi/transpose_cuda.cu where it takes the sizes): the NumPy layout,
    byte for byte."""
    rng = np.random.default_rng(m + c)
    x = rng.integers(0, 256, (m, c)).astype(np.uint8).view(np.dtype(E4M3))
    mp = gw.padded_columns(m, len(sizes))
    fn = jax.jit(lambda x, ends: gw.pad_transpose(x, ends, mp, transpose=gw._transpose_bytes))
    ends = gg.clamped_group_ends(jnp.asarray(sizes, jnp.int32), m)
    x_gpu, ends_gpu = jax.device_put(x, gpu_device), jax.device_put(ends, gpu_device)
    text = fn.lower(x_gpu, ends_gpu).as_text()
    assert ("jax_fp8_transpose_bytes" in text) == (c % 4 == 0), text[-2000:]
    got = np.asarray(fn(x_gpu, ends_gpu)).view(np.uint8)
    np.testing.assert_array_equal(got, padded_oracle(x, sizes, mp))


@pytest.mark.gpu
def test_gpu_refused_sizes_fall_back(gpu_device):
    """N % 8 with a bf16 output: no custom call, the reference's numbers, and explain says
    why."""
    rng = np.random.default_rng(5)
    lhs = exact_values(rng, (16, 32), E4M3)
    grad = exact_values(rng, (16, 20), E5M2)
    sizes, ls, gs = (7, 5), scales(rng, 2), scales(rng, 2)
    ops = (lhs, grad, np.asarray(sizes, np.int32), ls, gs)
    tgg.assert_falls_back(gw.grouped_wgrad, gw.TARGET, gpu_device, ops, jnp.bfloat16,
                          oracle(lhs, grad, sizes, ls, gs, jnp.bfloat16))


def test_kernel_wrapper_lowered_for_cuda():
    """The kernel's lowering (the padded transpose, then the custom call), lowered for
    CUDA without a GPU: one custom call of the padded FP8 operands [K, Mp] and [N, Mp], the
    group sizes (clamped by the kernel to the attribute m = M, as the padded layout clamps
    them) and the scales, into [G, K, N] and the grouped GEMM's workspace; float16 out
    through the kernel's float32."""
    if not hasattr(_registration.CPU_MODULE or _registration.CUDA_MODULE,
                   "grouped_gemm_workspace_bytes"):
        pytest.skip("the built module predates the grouped GEMM")
    m, k, n, g = 40, 24, 16, 5
    mp = gw.padded_columns(m, g)
    for out_dtype, kernel_out in ((jnp.bfloat16, "bf16"), (np.float16, "f32")):
        fn = jax.jit(functools.partial(gw._ffi_grouped_wgrad, out_dtype=np.dtype(out_dtype),
                                       kernel=True))
        text = fn.trace(*_avals(m=m, k=k, n=n, g=g)).lower(
            lowering_platforms=("cuda",)).as_text()
        calls = [ln for ln in text.splitlines()
                 if "stablehlo.custom_call @jax_fp8_grouped_wgrad(" in ln]
        assert len(calls) == 1, calls
        (line,) = calls
        assert (f"(tensor<{k}x{mp}xf8E4M3FN>, tensor<{n}x{mp}xf8E5M2>, tensor<{g}xi32>, "
                f"tensor<{g}xf32>, tensor<{g}xf32>) -> (tensor<{g}x{k}x{n}x{kernel_out}>, "
                f"tensor<{gg.workspace_bytes(g)}xui8>)") in line, line
        assert f"m = {m} : i64" in line, line      # the kernel clamps the sizes to M rows
