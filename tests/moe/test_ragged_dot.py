"""jax_fp8.fp8_ragged_dot (SPEC "Grouped GEMMs"): every recipe bit for bit against the NumPy
oracle of tests/moe/moe_reference.py (forward, both gradients, delayed scaling's per-expert
amaxes), with uneven and empty groups, rows past the groups, clamped sizes and NaN / inf;
then the transforms (jit, vmap, grad, remat) and the errors.

Exactness (`exact_operands`): every value is v * 2**k with v in {1/4, 3/8, ..., 6} (at most
three significant bits) and one peak of 7 * 2**k in each group of rows (each expert's
weight), k per group (expert). Every scale the recipes take is then a power of two (448 / 7
= 2**6, 57344 / 7 = 2**13; block and MXFP8 scales are powers of two), so the FP8 values are
the operands scaled exactly, every product is exact in float32 and every partial sum (at
most 136 terms, values within 2**4 * 28 of the smallest granularity) is below 2**24 times
the granularity: each GEMM's float32 sum is exact in any order, the oracle's float64 sum
rounded to float32. The result then takes the same one or two float32 multiplies and one
rounding on both sides.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp8
import moe_reference as ref
from jax_fp8 import Format
from jax_fp8._primitives import grouped_wgrad as gw
from jax_fp8.state import ScalingState

F32 = np.float32
M, K, N, G = 64, 136, 24, 5
SIZES = np.array([13, 0, 29, 7, 0], np.int32)        # 49 rows in groups, 15 past them
SET = np.array([0, .25, .375, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
RECIPES = {
    "delayed": jax_fp8.DelayedScaling(history_len=4),
    "delayed_e4m3": jax_fp8.DelayedScaling(history_len=4, fp8_format=Format.E4M3),
    "current": jax_fp8.Float8CurrentScaling(),
    "current_e4m3_pow2": jax_fp8.Float8CurrentScaling(fp8_format=Format.E4M3,
                                                      power_of_2_scale=True),
    "block": jax_fp8.Float8BlockScaling(),
    "block_hybrid_w1d": jax_fp8.Float8BlockScaling(fp8_format=Format.HYBRID,
                                                   w_block_scaling_dim=1),
    "mxfp8": jax_fp8.MXFP8BlockScaling(),
    "mxfp8_hybrid": jax_fp8.MXFP8BlockScaling(fp8_format=Format.HYBRID),
}
_EXP = {np.dtype(ml_dtypes.float8_e4m3fn): 6, np.dtype(ml_dtypes.float8_e5m2): 13}


def exact_operands(rng, shape, units, ks):
    """Values v * 2**k[u] (v from SET, random sign) with one +-7 * 2**k[u] peak in each unit
    u: units is a list of index expressions (groups of rows, or experts)."""
    x = rng.choice(SET, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    for u, k in zip(units, ks):
        block = x[u]
        if block.size:
            flat = block.reshape(-1)
            flat[rng.integers(flat.size)] = 7.0 * rng.choice([-1.0, 1.0])
            x[u] = flat.reshape(block.shape) * 2.0 ** k
    return x.astype(F32)


def case(rng, sizes=SIZES, m=M):
    bnds = ref.bounds(sizes, m)
    rows = [slice(a, b) for a, b in bnds] + [slice(bnds[-1][1], m)]
    kx, kg, kw = (rng.integers(-2, 3, size=len(rows)) for _ in range(3))
    x = exact_operands(rng, (m, K), rows, kx)
    ct = exact_operands(rng, (m, N), rows, kg)
    w = exact_operands(rng, (G, K, N), list(range(G)), kw[:G])
    return x, w, ct, (kx[:G], kw[:G], kg[:G])


def meta_and_oracle(recipe, rng, ks):
    fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    meta = jax_fp8.Fp8Meta.create(recipe, shape=(G,))
    if recipe.keeps_state:
        kx, kw, kg = ks
        # power-of-two scales at or below 448 / amax (E5M2: 57344 / amax)
        scales = {"input": 2.0 ** (_EXP[fwd] - kx - rng.integers(0, 3, G)),
                  "kernel": 2.0 ** (_EXP[fwd] - kw - rng.integers(0, 3, G)),
                  "grad": 2.0 ** (_EXP[bwd] - kg - rng.integers(0, 3, G))}
        scales = {r: s.astype(F32) for r, s in scales.items()}
        meta = jax_fp8.Fp8Meta(**{
            role: ScalingState(getattr(meta, role).amax_history, jnp.asarray(scales[role]),
                               jnp.asarray(F32(1) / scales[role]),
                               fp8_dtype=getattr(meta, role).fp8_dtype)
            for role in jax_fp8.Fp8Meta.STATES})
        return meta, ref.PerGroup(fwd, bwd, scales=scales)
    name = type(recipe).__name__
    if name == "Float8CurrentScaling":
        return meta, ref.PerGroup(fwd, bwd, power_of_2_scale=recipe.power_of_2_scale,
                                  amax_epsilon=recipe.amax_epsilon)
    if name == "Float8BlockScaling":
        return meta, ref.Blocked(fwd, bwd, w_tiles=recipe.w_block_scaling_dim == 2,
                                 power_of_2_scale=recipe.power_of_2_scale)
    return meta, ref.Blocked(fwd, bwd, mxfp8=True)


@jax.jit
def _zero(meta):
    return jax.tree.map(jnp.zeros_like, meta)


@functools.partial(jax.jit, static_argnums=(5,))
def _run(x, w, sizes, meta, ct, out_dtype):
    def fn(x, w, meta):
        return jax_fp8.fp8_ragged_dot(x, w, sizes, meta, preferred_element_type=out_dtype)
    (out, meta_out), vjp = jax.vjp(fn, x, w, meta)
    dx, dw, dmeta = vjp((ct.astype(out.dtype), jax.tree.map(jnp.zeros_like, meta_out)))
    return out, dx, dw, dmeta


def run(x, w, sizes, meta, ct, out_dtype):
    """(out, dx, dw, the meta's cotangent) under jit."""
    return _run(x, w, jnp.asarray(sizes), meta, ct, np.dtype(out_dtype))


def assert_same(got, want, what):
    got = np.asarray(got)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    np.testing.assert_array_equal(got.astype(F32), want.astype(F32), err_msg=what)


def check(recipe, x, w, sizes, ct, meta, oracle, out_dtype, in_dtype):
    xi, wi = jnp.asarray(x, in_dtype), jnp.asarray(w, in_dtype)
    out, dx, dw, dmeta = run(xi, wi, sizes, meta, jnp.asarray(ct), out_dtype)
    want, res = oracle.forward(np.asarray(xi).astype(F32), np.asarray(wi).astype(F32), sizes,
                               np.dtype(out_dtype))
    assert_same(out, want, "out")
    ct_seen = np.asarray(jnp.asarray(ct).astype(out_dtype)).astype(F32)
    want_dx, want_dw = oracle.backward(res, ct_seen, np.dtype(in_dtype), np.dtype(in_dtype))
    assert_same(dx, want_dx, "dx")
    assert_same(dw, want_dw, "dw")
    if recipe.keeps_state:
        bnds = ref.bounds(sizes, x.shape[0])

        for role, amax in (("input", ref.group_amax(np.asarray(xi), bnds)),
                           ("kernel", ref.expert_amax(np.asarray(wi))),
                           ("grad", ref.group_amax(ct_seen, bnds))):
            h = np.asarray(getattr(dmeta, role).amax_history)
            assert h.shape == (G, recipe.history_len)
            # staged as fmax(cotangent of the returned meta (0 here), amax): NaN ignored,
            # as the update's fmaxf would
            np.testing.assert_array_equal(h[:, 0], np.fmax(F32(0), amax), err_msg=role)
            np.testing.assert_array_equal(h[:, 1:], 0)
    return np.asarray(out)


FAMILIES = ("delayed", "current", "block", "mxfp8")
DTYPE_CASES = ([(n, np.float32, np.float32) for n in sorted(RECIPES)]
               + [(n, jnp.bfloat16, jnp.bfloat16) for n in FAMILIES]
               + [(n, np.float16, np.float32) for n in FAMILIES])


@pytest.mark.parametrize("name,out_dtype,in_dtype", DTYPE_CASES)
def test_every_recipe_bit_exact(name, out_dtype, in_dtype):
    recipe = RECIPES[name]
    rng = np.random.default_rng(abs(hash(name)) % 1000)
    x, w, ct, ks = case(rng)
    meta, oracle = meta_and_oracle(recipe, rng, ks)
    check(recipe, x, w, SIZES, ct, meta, oracle, out_dtype, in_dtype)


@pytest.mark.parametrize("name", ["delayed", "block"])   # one per-group, one blocked
@pytest.mark.parametrize("sizes", [[20, -3, 30, 40, 5],      # negative; past M: cut
                                   [0, 0, 0, 0, 0],          # no group: all zeros
                                   [64, 0, 0, 0, 0]])        # one group holds every row
def test_group_sizes_clamped_as_the_primitive(name, sizes):
    recipe = RECIPES[name]
    rng = np.random.default_rng(7)
    sizes = np.array(sizes, np.int32)
    x, w, ct, ks = case(rng, sizes)
    meta, oracle = meta_and_oracle(recipe, rng, ks)
    check(recipe, x, w, sizes, ct, meta, oracle, np.float32, np.float32)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_nan_and_inf_stay_in_their_group(name):
    """A NaN and an inf in one group's rows and a NaN in one expert's weight: the oracle's
    numbers (NaN in those groups' rows only, inf saturated or scale 1, NaN ignored by a
    block's amax)."""
    recipe = RECIPES[name]
    rng = np.random.default_rng(11)
    x, w, ct, ks = case(rng)
    x[0, 3] = np.nan          # group 0
    x[20, 5] = np.inf         # group 2
    x[60, 7] = np.nan         # past the groups: no effect anywhere
    w[3, 9, 4] = np.nan       # expert 3 (group 3's rows, column 4)
    # group 3; its row and column otherwise 0, so that the sums stay exact beside
    # the saturated value (+-fp8_max times a scale of 1)
    ct[45, :] = 0
    ct[42:49, 2] = 0
    ct[45, 2] = -np.inf
    meta, oracle = meta_and_oracle(recipe, rng, ks)
    out = check(recipe, x, w, SIZES, ct, meta, oracle, np.float32, np.float32)
    # (row 20, with the inf, is the recipe's: MXFP8 dequantizes 448 * 2**127 to inf)
    assert np.isnan(out[0]).all() and not np.isnan(np.delete(out[1:42], 19, 0)).any()
    assert np.isnan(out[42:49, 4]).all() and not np.isnan(np.delete(out[42:49], 4, 1)).any()
    np.testing.assert_array_equal(out[49:], 0)


@pytest.mark.parametrize("name", FAMILIES)
def test_random_operands_within_the_gemm_bound(name):
    """Random operands (no exact sums): each group's product is its GEMM's float32 sum of
    the dequantized products, within the bound of the block GEMM's reference,
    |out - E| <= (K + 4) u S (1 + u) + u |E| (u = 2**-24, float32 out), E the oracle's
    product (exact in float64, rounded to float32: one more u |E|) and S the same product
    of |x| and |w| (quantization is symmetric: |q(x)| = q(|x|), the same scales)."""
    recipe = RECIPES[name]
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((M, K)) * np.exp(rng.standard_normal((M, 1)))).astype(F32)
    w = rng.standard_normal((G, K, N)).astype(F32)
    _, oracle = meta_and_oracle(recipe, rng, (np.zeros(G), np.zeros(G), np.zeros(G)))
    meta = jax_fp8.Fp8Meta.create(recipe, shape=(G,))
    if recipe.keeps_state:   # scales 448 / amax of each group and expert, not powers of 2
        bnds = ref.bounds(SIZES, M)
        amax_x, amax_w = ref.group_amax(x, bnds), ref.expert_amax(w)
        with np.errstate(divide="ignore"):
            inv_x = F32(448) / amax_x
        scales = {"input": np.where(amax_x > 0, inv_x, 1).astype(F32),
                  "kernel": (F32(448) / amax_w).astype(F32), "grad": np.ones(G, F32)}
        oracle = ref.PerGroup(oracle.fwd, oracle.bwd, scales=scales)
        meta = jax_fp8.Fp8Meta(**{
            r: ScalingState(getattr(meta, r).amax_history, jnp.asarray(scales[r]),
                            jnp.asarray(F32(1) / scales[r]), fp8_dtype=getattr(meta, r).fp8_dtype)
            for r in jax_fp8.Fp8Meta.STATES})
    got = np.asarray(jax.jit(lambda x, w, m: jax_fp8.fp8_ragged_dot(x, w, SIZES, m)[0])(
        x, w, meta)).astype(np.float64)
    want = oracle.forward(x, w, SIZES, np.float32)[0].astype(np.float64)
    s = oracle.forward(np.abs(x), np.abs(w), SIZES, np.float32)[0].astype(np.float64)
    u = 2.0 ** -24
    bound = (K + 4) * u * s * (1 + u) + 2 * u * np.abs(want)
    assert (np.abs(got - want) <= bound).all(), float(np.max(np.abs(got - want) - bound))


def test_empty_group_keeps_its_delayed_state():
    """An empty group's input and gradient amaxes are 0, so the fused update keeps their
    scales (one update_states for the [G, L] states); the others move."""
    recipe = RECIPES["delayed"]
    rng = np.random.default_rng(3)
    x, w, ct, ks = case(rng)
    meta = jax_fp8.Fp8Meta.create(recipe, shape=(G,))
    _, _, _, dmeta = run(jnp.asarray(x), jnp.asarray(w), SIZES, meta, jnp.asarray(ct),
                         np.float32)
    new = jax_fp8.new_fp8_state(meta, jax_fp8.fp8_grads_from_cotangents(dmeta), recipe)
    for role in ("input", "grad"):
        s = np.asarray(getattr(new, role).scale)
        np.testing.assert_array_equal(s[[1, 4]], 1.0)
        assert (s[[0, 2, 3]] != 1.0).all()
    assert (np.asarray(new.kernel.scale) != 1.0).all()
    # the update of [G, L] states is SPEC's, per expert
    h = np.asarray(dmeta.input.amax_history[:, 0])
    with np.errstate(divide="ignore"):
        want = (F32(448) / h).astype(F32)
    np.testing.assert_array_equal(np.asarray(new.input.scale)[[0, 2, 3]], want[[0, 2, 3]])


# ----------------------------------------------------------------- transforms, errors

def _x_w(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=(M, K)), dtype),
            jnp.asarray(rng.normal(size=(G, K, N)), dtype))


@pytest.mark.parametrize("name", ["delayed", "mxfp8"])
def test_eager_equals_jit(name):
    recipe = RECIPES[name]
    x, w = _x_w()
    meta = jax_fp8.Fp8Meta.create(recipe, shape=(G,))
    eager = jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)[0]
    jitted = jax.jit(lambda x, w, m: jax_fp8.fp8_ragged_dot(x, w, SIZES, m)[0])(x, w, meta)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_vmap_refused_naming_the_fix(name):
    """jax.lax.ragged_dot has no batching rule for a batch of token arrays; neither has the
    grouped GEMM: a clear error at trace time, and lax.map gives each element's GEMM."""
    meta = jax_fp8.Fp8Meta.create(RECIPES[name], shape=(G,))
    x, w = _x_w()
    xs = jnp.stack([x, -2 * x])
    fn = lambda x: jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)[0]  # noqa: E731
    with pytest.raises(NotImplementedError, match="jax.lax.map"):
        jax.vmap(fn)(xs)
    got = jax.lax.map(fn, xs)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(fn(xs[i])))


def test_remat_same_bits():
    recipe = RECIPES["delayed"]
    x, w = _x_w()
    meta = jax_fp8.Fp8Meta.create(recipe, shape=(G,))

    def loss(x, w, meta):
        out, _ = jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)
        return jnp.sum(out ** 2)

    plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, meta)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(x, w, meta)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_second_order_refused():
    meta = jax_fp8.Fp8Meta.create(RECIPES["current"], shape=(G,))
    x, w = _x_w()

    def loss(x):
        return jnp.sum(jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)[0] ** 2)

    with pytest.raises(NotImplementedError, match="fp8_ragged_dot"):
        jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))(x)


def test_delayed_meta_must_be_differentiated_and_threaded():
    meta = jax_fp8.Fp8Meta.create(RECIPES["delayed"], shape=(G,))
    x, w = _x_w()
    with pytest.raises(ValueError, match="not"):
        jax.grad(lambda x: jnp.sum(jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)[0]))(x)

    def twice(x, meta):
        a, _ = jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)
        b, _ = jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)
        return jnp.sum(a + b)

    with pytest.raises(ValueError, match="Thread it"):
        jax.grad(twice, argnums=(0, 1))(x, meta)


def test_errors_name_the_fix():
    x, w = _x_w()
    delayed = RECIPES["delayed"]
    with pytest.raises(ValueError, match=r"shape=\(5,\)"):
        jax_fp8.fp8_ragged_dot(x, w, SIZES, jax_fp8.Fp8Meta.create(delayed))
    meta = jax_fp8.Fp8Meta.create(delayed, shape=(G,))
    with pytest.raises(NotImplementedError, match="group_offset"):
        jax_fp8.fp8_ragged_dot(x, w, SIZES, meta, group_offset=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape"):
        jax_fp8.fp8_ragged_dot(x, w, SIZES[:3], meta)
    with pytest.raises(ValueError, match=r"group_sizes must be an integer"):
        jax_fp8.fp8_ragged_dot(x, w, SIZES.astype(np.float32), meta)
    with pytest.raises(ValueError, match=r"rhs \[G, K, N\]"):
        jax_fp8.fp8_ragged_dot(x, w[0], SIZES, meta)
    with pytest.raises(TypeError, match="preferred_element_type"):
        jax_fp8.fp8_ragged_dot(x, w, SIZES, meta, preferred_element_type=jnp.int32)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jax_fp8.fp8_ragged_dot(x.astype(jnp.int32), w, SIZES, meta)
    tiles = jax_fp8.Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    with pytest.raises(ValueError, match="x_block_scaling_dim=1"):
        jax_fp8.fp8_ragged_dot(x, w, SIZES, jax_fp8.Fp8Meta.create(tiles))


def test_min_fp8_flops_keeps_ragged_dot():
    x, w = _x_w(jnp.bfloat16)
    meta = jax_fp8.Fp8Meta.create(RECIPES["delayed"], shape=(G,))
    assert jax_fp8.gemm.ragged_fp8.ragged_dot_flops(x.shape, w.shape) == 2 * M * K * N
    out, same = jax_fp8.fp8_ragged_dot(x, w, SIZES, meta, min_fp8_flops=2 * M * K * N + 1)
    assert same is meta
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.lax.ragged_dot(x, w, SIZES)))


def test_ragged_dot_general_forms():
    x, w = _x_w()
    meta = jax_fp8.Fp8Meta.create(RECIPES["current"], shape=(G,))
    want = jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)[0]
    kn = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
    nk = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))
    got_kn = jax_fp8.fp8_ragged_dot_general(x, w, SIZES, kn, meta)[0]
    got_nk = jax_fp8.fp8_ragged_dot_general(x, jnp.swapaxes(w, 1, 2), SIZES, nk, meta)[0]
    np.testing.assert_array_equal(np.asarray(got_kn), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_nk), np.asarray(want))
    contracting = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())
    with pytest.raises(NotImplementedError, match="mixture-of-experts form"):
        jax_fp8.fp8_ragged_dot_general(x, x, SIZES, contracting, meta)


def test_explain_reports_the_grouped_gemms():
    """explain's rows: the grouped GEMM primitive twice (forward, input gradient) and the
    weight gradient the grouped weight-gradient primitive (its reference unless switched
    on); block scaling's grouped GEMMs named as emulated; a plain ragged_dot not FP8."""
    from jax_fp8.devtools import explain
    x, w = _x_w(jnp.bfloat16)

    def step(x, w, meta):
        def loss(x, w, meta):
            return jnp.sum(jax_fp8.fp8_ragged_dot(x, w, SIZES, meta)[0].astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, meta)

    rows = explain.explain(step, x, w, jax_fp8.Fp8Meta.create(RECIPES["delayed"], shape=(G,)),
                           platform="cuda")
    grouped = [r for r in rows if r.name == "jax_fp8_grouped_gemm"]
    assert [r.operands[:2] for r in grouped] == [
        ("float8_e4m3fn[64,136]", "float8_e4m3fn[5,24,136]"),
        ("float8_e5m2[64,24]", "float8_e4m3fn[5,136,24]")]
    wgrad = [r for r in rows if r.name == "jax_fp8_grouped_wgrad"]
    assert [r.operands[:2] for r in wgrad] == [("float8_e4m3fn[64,136]", "float8_e5m2[64,24]")]
    if not gw.KERNEL_ON:     # the default: the reference, and why
        assert [r.lowering for r in wgrad] == ["reference"]
        assert wgrad[0].why in (gw.OFF_REASON, "the cuda kernel is not built in this process")
    assert not [r for r in rows if r.name == "ragged_dot_general"]
    rows = explain.explain(step, x, w, jax_fp8.Fp8Meta.create(RECIPES["block"]))
    assert {r.lowering for r in rows if r.name == "ragged_dot_general"} == {"blocks emulated"}
    plain = explain.explain(lambda x, w: jax.lax.ragged_dot(x, w, SIZES), x, w)
    assert [(r.name, r.lowering, r.flops) for r in plain] == [
        ("ragged_dot_general", "bfloat16", 2 * M * K * N)]
