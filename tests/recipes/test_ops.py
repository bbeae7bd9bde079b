"""Quantize/dequantize, the FP8 dot_general and how its amaxes combine."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
from helpers import rand
from jax_fp8 import Fp8Meta, ScalingState

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HI = jax.lax.Precision.HIGHEST
DN = (((1,), (0,)), ((), ()))
RECIPE = jax_fp8.DelayedScaling(history_len=4)


# These tests pin the op's semantics bit for bit, so they run on the CPU backend
# (deterministic GEMM accumulation order, like for like with the references). FP8
# GEMMs on a GPU are exercised by tests/flax_models/test_train_step_hlo.py.
pytestmark = pytest.mark.usefixtures("on_cpu")


def state(scale, dtype=E4M3, length=4):
    # NumPy leaves: building test inputs compiles nothing.
    s = np.float32(scale)
    return ScalingState(np.zeros((length,), np.float32), np.asarray(s),
                        np.asarray(np.float32(1) / s), fp8_dtype=dtype)


def meta_with(s_in=1.0, s_k=1.0, s_g=1.0):
    return Fp8Meta(state(s_in), state(s_k), state(s_g, E5M2))


def staged(g):
    return np.stack([np.asarray(a) for a in jax.tree.leaves(jax_fp8.amax_cotangents(g))])


# ------------------------------------------------------------------ quantize & amax

@pytest.mark.parametrize("dtype,fmax", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_quantize_saturates_and_keeps_nan(dtype, fmax):
    st = state(2.0, dtype)
    x = jnp.array([0.0, 1.0, -1.5, 1e6, -1e6, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    q = jax_fp8.quantize(x, st)
    assert q.dtype == dtype
    got = np.asarray(q.astype(jnp.float32))
    np.testing.assert_array_equal(got[:7], [0.0, 2.0, -3.0, fmax, -fmax, fmax, -fmax])
    assert np.isnan(got[7])


def test_quantize_dequantize_roundtrip_and_scale_convention():
    x = rand(0, (64, 32), 3.0)
    amax = float(jax_fp8.compute_amax(x))
    st = state(448.0 / amax)                   # docs/semantics.md: x_fp8 = x * scale
    q = jax_fp8.quantize(x, st)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == pytest.approx(448.0, rel=0.07)
    back = jax_fp8.dequantize(q, st, jnp.float32)
    np.testing.assert_allclose(back, x, rtol=0.0725, atol=1e-6 * amax)
    assert jax_fp8.dequantize(q, st, jnp.bfloat16).dtype == jnp.bfloat16


def test_quantize_stacked_state_scales_leading_axes():
    st = ScalingState(jnp.zeros((2, 4)), jnp.array([1.0, 4.0]), jnp.array([1.0, 0.25]))
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(jax_fp8.quantize(x, st).astype(jnp.float32), [[1] * 3, [4] * 3])


def test_compute_amax():
    x = jnp.array([[1.0, -7.5], [3.0, 0.25]], jnp.bfloat16)
    a = jax_fp8.compute_amax(x)
    assert a.dtype == jnp.float32 and a.shape == () and float(a) == 7.5
    assert float(jax_fp8.compute_amax(jnp.zeros((0, 3)))) == 0.0
    assert np.isnan(float(jax_fp8.compute_amax(jnp.array([1.0, jnp.nan]))))


# ------------------------------------------------------------------ dot_general numerics

@jax.jit
def _manual(x, w, g, meta):
    """The same computation spelled out: quantize-dequantize everything, f32 GEMMs."""
    qdq = lambda t, st: jax_fp8.dequantize(jax_fp8.quantize(t, st), st)  # noqa: E731
    xq, wq, gq = qdq(x, meta.input), qdq(w, meta.kernel), qdq(g, meta.grad)
    mm = functools.partial(jnp.matmul, precision=HI)      # no TF32 in the reference
    return mm(xq, wq), mm(gq, wq.T), mm(xq.T, gq)


def test_dot_general_forward_backward_match_quantized_reference():
    x, w = rand(0, (16, 32), 2.0), rand(1, (32, 24), 0.1)
    meta = meta_with(448 / 8.0, 448 / 0.5, 57344 / 4.0)
    g = rand(2, (16, 24))
    @jax.jit
    def run(x, w, meta, g):
        (out, meta_out), vjp = jax.vjp(lambda x, w, m: jax_fp8.fp8_dot_general(x, w, DN, m),
                                       x, w, meta)
        return out, meta_out, vjp((g, jax.tree.map(jnp.zeros_like, meta)))

    out, meta_out, (gx, gw, gm) = run(x, w, meta, g)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), meta_out, meta))
    ref_out, ref_gx, ref_gw = _manual(x, w, g, meta)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, ref_gw, rtol=1e-5, atol=1e-4)
    # The observed amaxes come back as the meta's cotangent, amax records: the amax in the
    # staging slot, its low part (below its 12 leading significant bits) in the scale
    # slot, the unit 1 in the scale_inv slot.
    amaxes = [jax_fp8.compute_amax(x), jax_fp8.compute_amax(w), jax_fp8.compute_amax(g)]
    np.testing.assert_array_equal(staged(gm), amaxes)
    for st, amax in zip((gm.input, gm.kernel, gm.grad), amaxes):
        assert not np.any(np.asarray(st.amax_history[1:]))
        high = np.asarray(amax, np.float32).view(np.uint32) & np.uint32(0xFFFFF000)
        assert float(st.scale) == float(np.float32(amax) - high.view(np.float32))
        assert float(st.scale_inv) == 1
    np.testing.assert_array_equal(jax_fp8.amax_cotangents([gm.input, gm.kernel, gm.grad]),
                                  amaxes)


def test_dot_general_close_to_full_precision_with_calibrated_scales():
    x, w = rand(3, (32, 64)), rand(4, (64, 48), 0.2)
    fwd = lambda x, w, m: jax_fp8.fp8_dot_general(x, w, DN, m)[0]  # noqa: E731
    loss = lambda x, w, m: jnp.sum(jnp.sin(fwd(x, w, m)))  # noqa: E731
    ref_loss = lambda x, w: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    # Calibrate: one step at scale 1 records the amaxes, one update sets the scales.
    meta = Fp8Meta.create(RECIPE)
    gm = jax.jit(jax.grad(loss, argnums=2))(x, w, meta)
    meta = jax_fp8.new_fp8_state(meta, gm, RECIPE)
    with jax_fp8.frozen_scales():  # gradients at fixed scales
        out, (gx, gw) = jax.jit(lambda x, w, m: (fwd(x, w, m), jax.grad(loss, argnums=(0, 1))(
            x, w, m)))(x, w, meta)
    ref_gx, ref_gw = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(x, w)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))  # noqa: E731
    assert rel(out, x @ w) < 0.05
    assert rel(gx, ref_gx) < 0.1 and rel(gw, ref_gw) < 0.1


def test_dot_general_uses_fp8_operands_in_both_passes():
    x, w = rand(0, (16, 32)), rand(1, (32, 16))  # sizes FP8 GEMMs take
    f = lambda x, w, m: jnp.sum(jax_fp8.fp8_dot_general(x, w, DN, m)[0])  # noqa: E731
    with jax_fp8.frozen_scales():
        hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(x, w, meta_with()).as_text()
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    # One forward and two backward GEMMs, all on FP8 operands (E5M2 gradient), f32 result.
    assert len(dots) == 3, dots
    for line in dots:
        operands = line.split(":")[-1]
        assert operands.count("f8E") == 2 and operands.strip().endswith("f32>"), line
    assert sum("f8E5M2" in line for line in dots) == 2


@pytest.mark.parametrize("shapes,dn", [
    (((2, 5, 8), (8, 3)), (((2,), (0,)), ((), ()))),                 # Dense on 3-D input
    (((4, 6, 5), (4, 5, 7)), (((2,), (1,)), ((0,), (0,)))),          # batch dims
    (((3, 4, 6), (4, 6, 5)), (((1, 2), (0, 1)), ((), ()))),          # two contracted axes
])
def test_dot_general_dimension_numbers(shapes, dn):
    x, w = rand(5, shapes[0]), rand(6, shapes[1])
    meta = meta_with(4.0, 4.0, 4.0)

    @jax.jit
    def run(x, w):
        f = lambda x, w: jnp.sum(jnp.cos(jax_fp8.fp8_dot_general(x, w, dn, meta)[0]))  # noqa: E731
        qdq = lambda t, st: jax_fp8.dequantize(jax_fp8.quantize(t, st), st)  # noqa: E731
        # Reference: lax.dot_general on the dequantized operands, gradient quantized too.
        out, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dn, precision=HI),
                           qdq(x, meta.input),
                           qdq(w, meta.kernel))
        ref = (out, *vjp(qdq(-jnp.sin(out), meta.grad)))
        got = (jax_fp8.fp8_dot_general(x, w, dn, meta)[0], *jax.grad(f, argnums=(0, 1))(x, w))
        return got, ref

    with jax_fp8.frozen_scales():
        got, ref = run(x, w)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_dot_general_dtypes():
    x, w = rand(0, (4, 8), dtype=jnp.bfloat16), rand(1, (8, 2), dtype=jnp.bfloat16)

    @jax.jit
    def run(x, w):
        out, _ = jax_fp8.fp8_dot_general(x, w, DN, meta_with())
        out32, _ = jax_fp8.fp8_dot_general(x, w, DN, meta_with(),
                                           preferred_element_type=jnp.float32)
        grads = jax.grad(lambda x, w: jnp.sum(jax_fp8.fp8_dot_general(
            x, w, DN, meta_with())[0].astype(jnp.float32)), argnums=(0, 1))(x, w)
        return out, out32, grads

    with jax_fp8.frozen_scales():
        out, out32, (gx, gw) = run(x, w)
    assert out.dtype == jnp.bfloat16 and out32.dtype == jnp.float32
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16


def test_dot_general_input_errors():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    with pytest.raises(TypeError, match="meta"):
        jax_fp8.fp8_dot_general(x, w, DN, {"input": None})
    stacked = Fp8Meta.create(RECIPE, shape=(2,))
    with pytest.raises(ValueError, match="meta.input"):
        jax_fp8.fp8_dot_general(x, w, DN, stacked)
    with pytest.raises(TypeError, match="lhs"):
        jax_fp8.fp8_dot_general(jnp.ones((2, 3), jnp.int32), w, DN, meta_with())


# ------------------------------------------------------------------ combining amaxes

def _amaxes_of_separate_uses(x, w, n_uses):
    """Per-use amaxes, each use with its own meta (the ground truth to max-reduce)."""
    def f(x, metas):
        for m in metas:
            x = jnp.tanh(jax_fp8.fp8_dot_general(x, w, DN, m)[0])
        return jnp.sum(x)
    metas = [meta_with(2.0, 2.0, 2.0) for _ in range(n_uses)]
    return np.stack([staged(g) for g in jax.jit(jax.grad(f, argnums=1))(x, metas)])


def test_reused_layer_threaded_meta_combines_by_max():
    x, w = rand(0, (8, 8)), rand(1, (8, 8), 0.7)

    def f(x, meta):
        for _ in range(3):
            y, meta = jax_fp8.fp8_dot_general(x, w, DN, meta)    # thread the meta
            x = jnp.tanh(y)
        return jnp.sum(x)

    got = staged(jax.jit(jax.grad(f, argnums=1))(x, meta_with(2.0, 2.0, 2.0)))
    per_use = _amaxes_of_separate_uses(x, w, 3)
    np.testing.assert_array_equal(got, per_use.max(axis=0))
    assert not np.allclose(got, per_use.sum(axis=0))


def test_unthreaded_reuse_is_an_error_at_trace_time():
    # JAX adds the cotangents of a reused value, which would sum the amaxes: a
    # differentiated meta given to two uses is refused, saying what to do instead.
    x, w = rand(0, (8, 8)), rand(1, (8, 8), 0.7)

    def f(x, meta):
        for _ in range(2):
            x = jnp.tanh(jax_fp8.fp8_dot_general(x, w, DN, meta)[0])   # meta NOT threaded
        return jnp.sum(x)

    with pytest.raises(ValueError, match="Thread it"):
        jax.jit(jax.grad(f, argnums=1))(x, meta_with(2.0, 2.0, 2.0))
    # Not differentiated (inference): reusing a meta is harmless and allowed.
    jax.jit(f)(x, meta_with(2.0, 2.0, 2.0))


def test_scan_over_stacked_layers_gives_per_layer_amaxes():
    n = 4
    x = rand(0, (8, 16))
    ws = jnp.stack([rand(10 + i, (16, 16), 0.2 * (i + 1)) for i in range(n)])
    metas = Fp8Meta.create(RECIPE, shape=(n,))

    def scanned(x, ws, metas):
        def body(h, layer):
            w, m = layer
            y, _ = jax_fp8.fp8_dot_general(h, w, DN, m)
            return jnp.tanh(y), None
        return jnp.sum(jax.lax.scan(body, x, (ws, metas))[0])

    def unrolled(x, ws, metas):
        for i in range(n):
            m = jax.tree.map(lambda a: a[i], metas)
            x = jnp.tanh(jax_fp8.fp8_dot_general(x, ws[i], DN, m)[0])
        return jnp.sum(x)

    g_scan = jax.jit(jax.grad(scanned, argnums=2))(x, ws, metas)
    g_unrolled = jax.jit(jax.grad(unrolled, argnums=2))(x, ws, metas)
    assert g_scan.input.amax_history.shape == (n, 4)
    np.testing.assert_array_equal(staged(g_scan), staged(g_unrolled))
    np.testing.assert_array_equal(staged(g_scan)[1], [float(jax_fp8.compute_amax(w)) for w in ws])
    # One fused update for the stacked state of every layer.
    new = jax_fp8.new_fp8_state(metas, g_scan, RECIPE)
    np.testing.assert_array_equal(new.kernel.amax_history[:, -1], staged(g_scan)[1])


def test_scan_reusing_one_layer_through_the_carry_combines_by_max():
    x, w = rand(0, (8, 8)), rand(1, (8, 8), 0.7)

    def f(x, meta):
        def body(carry, _):
            h, m = carry
            y, m = jax_fp8.fp8_dot_general(h, w, DN, m)
            return (jnp.tanh(y), m), None
        (h, _), _ = jax.lax.scan(body, (x, meta), None, length=3)
        return jnp.sum(h)

    got = staged(jax.jit(jax.grad(f, argnums=1))(x, meta_with(2.0, 2.0, 2.0)))
    np.testing.assert_allclose(got, _amaxes_of_separate_uses(x, w, 3).max(axis=0), rtol=1e-6)


def test_microbatch_accumulation_combines_by_max():
    x, w = rand(0, (32, 16), 1.0), rand(1, (16, 8), 0.3)
    x = x.at[5].multiply(10.0)          # one microbatch holds the largest input
    meta = meta_with(4.0, 4.0, 4.0)

    def loss(x, w, m):                 # a sum over examples: per-example grads match
        return jnp.sum(jnp.sin(jax_fp8.fp8_dot_general(x, w, DN, m)[0]))

    _, g_full = jax.jit(jax.grad(loss, argnums=(1, 2)))(x, w, meta)

    def micro(acc, xb):
        gw, gm = jax.grad(loss, argnums=(1, 2))(xb, w, meta)
        acc_w, acc_m = acc
        return (acc_w + gw, jax_fp8.combine_fp8_grads(acc_m, gm)), None

    zero_m = jax.tree.map(jnp.zeros_like, meta)
    (gw_acc, gm_acc), _ = jax.lax.scan(micro, (jnp.zeros_like(w), zero_m), x.reshape(4, 8, 16))
    np.testing.assert_array_equal(staged(gm_acc), staged(g_full))
    per_micro = [staged(jax.jit(jax.grad(loss, argnums=2))(xb, w, meta))
                 for xb in x.reshape(4, 8, 16)]
    assert not np.allclose(staged(gm_acc), np.sum(per_micro, axis=0))


def test_combine_ignores_nan_like_the_update():
    a = jax.tree.map(jnp.zeros_like, meta_with())
    b = Fp8Meta(*(ScalingState(s.amax_history.at[0].set(v), s.scale, s.scale_inv,
                               fp8_dtype=s.fp8_dtype)
                  for s, v in zip((a.input, a.kernel, a.grad), (jnp.nan, 2.0, 3.0))))
    c = Fp8Meta(*(ScalingState(s.amax_history.at[0].set(v), s.scale, s.scale_inv,
                               fp8_dtype=s.fp8_dtype)
                  for s, v in zip((a.input, a.kernel, a.grad), (1.0, 5.0, 1.0))))
    np.testing.assert_array_equal(staged(jax_fp8.combine_fp8_grads(b, c)), [1.0, 5.0, 3.0])


# ------------------------------------------------------------------ the step update

def test_new_fp8_state_is_one_update_states_call():
    layers = {f"l{i}": Fp8Meta.create(RECIPE) for i in range(5)}
    grads = jax.tree.map(lambda s: s, layers)
    grads = jax.tree.map(lambda h: h, grads)
    amaxes = {f"l{i}": Fp8Meta(*(jnp.float32(i + k) for k in (1, 2, 3))) for i in range(5)}
    grads = jax.tree.map(
        lambda st, a: ScalingState(jnp.zeros_like(st.amax_history).at[0].set(a),
                                   jnp.zeros_like(st.scale), jnp.zeros_like(st.scale_inv),
                                   fp8_dtype=st.fp8_dtype),
        layers, amaxes, is_leaf=lambda s: isinstance(s, ScalingState))
    new = jax_fp8.new_fp8_state(layers, grads, RECIPE)
    want = jax_fp8.update_states(layers, amaxes, recipe=RECIPE)
    jax.tree.map(np.testing.assert_array_equal, new, want)
    hlo = jax.jit(jax_fp8.new_fp8_state, static_argnums=2).lower(layers, grads, RECIPE).as_text()
    calls = hlo.count("jax_fp8_update") if jax_fp8.HAS_CPU_KERNEL else None
    if calls is not None:
        assert jax.jit(jax_fp8.new_fp8_state, static_argnums=2).lower(
            layers, grads, RECIPE).compile().as_text().count(
                'custom_call_target="jax_fp8_update"') == 1


def test_jit_grad_update_loop_learns_scales():
    x, w = rand(0, (16, 32), 5.0), rand(1, (32, 8), 0.05)
    loss = lambda x, w, m: jnp.sum(jax_fp8.fp8_dot_general(x, w, DN, m)[0] ** 2)  # noqa: E731

    @jax.jit
    def step(meta):
        gm = jax.grad(loss, argnums=2)(x, w, meta)
        return jax_fp8.new_fp8_state(meta, gm, RECIPE)

    meta = Fp8Meta.create(RECIPE)
    for _ in range(2):
        meta = step(meta)
    assert float(meta.input.scale) == pytest.approx(448.0 / float(jax_fp8.compute_amax(x)))
    assert float(meta.kernel.scale) == pytest.approx(448.0 / float(jax_fp8.compute_amax(w)))
    assert meta.grad.fp8_dtype == np.dtype(E5M2)
    assert float(meta.grad.scale) > 1.0


# ------------------------------------------------------------------ einsum

@pytest.mark.parametrize("eqn,sa,sb", [
    ("bk,kn->bn", (4, 8), (8, 5)),
    ("bhsd,hdn->bsnh", (2, 3, 5, 7), (3, 7, 4)),
    ("bsd,hd->bhs", (2, 3, 8), (4, 8)),
    ("ab,cd->abd", (2, 3), (4, 5)),       # c summed away, no contraction
])
def test_einsum_matches_jnp(eqn, sa, sb):
    a, b = rand(1, sa), rand(2, sb)
    meta = meta_with(8.0, 8.0, 8.0)

    @jax.jit
    def run(a, b):
        qdq = lambda t, st: jax_fp8.dequantize(jax_fp8.quantize(t, st), st)  # noqa: E731
        out, _ = jax_fp8.fp8_einsum(eqn, a, b, meta)
        if "c" in eqn:   # the summed axis is reduced before quantization
            want = jnp.einsum("ab,d->abd", qdq(a, meta.input), qdq(b.sum(0), meta.kernel),
                              precision=HI)
        else:
            want = jnp.einsum(eqn, qdq(a, meta.input), qdq(b, meta.kernel), precision=HI)
        ga = jax.grad(lambda a: jnp.sum(jax_fp8.fp8_einsum(eqn, a, b, meta)[0]))(a)
        return out, want, ga

    with jax_fp8.frozen_scales():
        out, want, ga = run(a, b)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert ga.shape == a.shape


def test_einsum_errors():
    a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
    for eqn in ("ab,bc", "...a,ab->...b", "aa,ab->b", "ab,bc,cd->ad", "abc,bc->ac"):
        with pytest.raises(ValueError):
            jax_fp8.fp8_einsum(eqn, a, b, meta_with())


# ------------------------------------------------------------------ GEMM scale folding

_DOT_RE = re.compile(r"(%\w+) = stablehlo\.dot_general .*: \((tensor<[^>]*f8[^>]*>), "
                     r"(tensor<[^>]*>)\) -> tensor<[^>]*x(\w+)>")


_FP8_DOT_RE = re.compile(r"stablehlo\.dot_general [^:]*?(algorithm = <[^>]*>)?\s*: "
                         r"\((tensor<[^>]*f8[^>]*>), (tensor<[^>]*f8[^>]*>)\)")


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_fp8_gemms_name_their_accumulation_as_a_dot_algorithm_on_cuda(platform):
    """Lowered for CUDA, every FP8 GEMM carries a dot algorithm: float32 accumulation for
    the two gradient GEMMs, fast accumulation for the forward one (XLA:GPU then autotunes
    only cuBLASLt's FP8 GEMMs for them). Lowered for CPU, which takes no FP8 algorithm,
    none does. (Lowering needs no GPU.)"""
    x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 48), jnp.bfloat16)

    def loss(x, w, m):
        y, _ = jax_fp8.fp8_dot_general(x, w, DN, m)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = step.trace(x, w, Fp8Meta.create()).lower(lowering_platforms=(platform,)).as_text()
    dots = _FP8_DOT_RE.findall(text)
    assert len(dots) == 3, dots
    if platform == "cpu":
        assert [alg for alg, _, _ in dots] == ["", "", ""]
        return
    imprecise = {}
    for alg, lhs, rhs in dots:
        assert "accumulation_type = f32" in alg, alg
        imprecise[(lhs, rhs)] = "allow_imprecise_accumulation = true" in alg
    assert imprecise == {  # forward: x . (w^T)^T; gradients: g . w^T and x^T . g^T
        ("tensor<16x32xf8E4M3FN>", "tensor<48x32xf8E4M3FN>"): True,
        ("tensor<16x48xf8E5M2>", "tensor<32x48xf8E4M3FN>"): False,
        ("tensor<32x16xf8E4M3FN>", "tensor<48x16xf8E5M2>"): False}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_fp8_gemm_result_is_scaled_by_one_scalar_multiply_in_its_own_dtype(dtype):
    """XLA folds the dequantization into the cuBLASLt FP8 GEMM (its scale operand) only
    for multiply(gemm, broadcast(scalar)) in the GEMM's own dtype with the GEMM's result
    used once; anything else (a convert in between) leaves the multiply to the next
    fusion, which on the H200 made XLA fuse LayerNorm's backward 3x slower. Checked on
    the lowered program of a forward + backward, for all three FP8 GEMMs."""
    x, w = jnp.ones((16, 32), dtype), jnp.ones((32, 48), dtype)  # multiples of 16: FP8 GEMMs

    def loss(x, w, m):
        y, _ = jax_fp8.fp8_dot_general(x, w, DN, m)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w, Fp8Meta.create()).as_text()
    # Value names are unique within a function (the GEMMs may be functions of their own).
    dots = [(body, dot) for body in re.split(r"\n\s*func\.func ", text)
            for dot in _DOT_RE.findall(body)]
    assert len(dots) == 3, dots
    out_type = {jnp.bfloat16: "bf16", jnp.float32: "f32"}[dtype]
    for body, (name, _, _, result_type) in dots:
        assert result_type == out_type, (name, result_type)
        uses = [ln.strip() for ln in body.splitlines()
                if re.search(re.escape(name) + r"\b", ln) and not ln.strip().startswith(name + " ")]
        assert len(uses) == 1, (name, uses)
        mul = re.match(r"(%\w+) = stablehlo\.multiply " + re.escape(name) + r", (%\w+) : "
                       r"tensor<[^>]*x" + out_type + ">", uses[0])
        assert mul, uses[0]
        factor = mul.group(2)
        (factor_def,) = [ln for ln in body.splitlines() if ln.strip().startswith(factor + " = ")]
        assert "broadcast_in_dim" in factor_def and f"(tensor<{out_type}>)" in factor_def, \
            factor_def
