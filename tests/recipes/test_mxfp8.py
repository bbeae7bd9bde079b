"""MXFP8 (docs/semantics.md, "MXFP8"): quantize_mxfp8 bit for bit against a NumPy reference of
the E8M0 rule, the GEMM within the block GEMM's bound, and the recipe through fp8_dot_general,
explain, fp8_model and export. The recipe-parametrised tests elsewhere (the `recipe` fixture,
helpers.RECIPES) give it the coverage every recipe has; the 8-device partitioning is
mxfp8_worker.py's.

The bound (as the block GEMM's reference path, tests/kernels/test_block_gemm.py): the
dequantized operands are exact (FP8 times a power of two), a float32 dot of K products is
within (K + 2) u S of the float64 product E, one rounding to the output adds u_out |E|:
|out - E| <= (K + 4) u S (1 + u_out) + u_out |E|, S = sum_k |a_ik| |b_jk|, u = 2**-24.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import block_reference
import helpers
import jax_fp8
from jax_fp8.devtools import explain
from jax_fp8.flax import FP8_COLLECTION, Fp8TrainState, fp8_model
from jax_fp8.recipes import mxfp8

F32, U32 = np.float32, np.uint32
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
DN = (((1,), (0,)), ((), ()))
U = 2.0 ** -24
U_OUT = {np.dtype(np.float32): 2.0 ** -24, np.dtype(jnp.bfloat16): 2.0 ** -8}


# ------------------------------------------------------------------ the NumPy reference
# block_reference.quantize_mxfp8: SPEC's rule on float32 bits, NumPy's IEEE float32.

ref_quantize = block_reference.quantize_mxfp8


def special_rows(rng, k):
    """Rows whose blocks hold every special amax: zero, NaN (ignored), inf, subnormal,
    near FLT_MAX, exact powers of two times fp8_max (no round up) and their neighbours."""
    rows = []
    base = rng.standard_normal((14, k)).astype(F32)
    base[0] = 0                                               # all zero
    base[1, ::7] = np.nan                                     # NaN beside finite values
    base[2, 3] = np.inf                                       # inf: e = 254
    base[3, 5] = -np.inf
    base[4] = rng.standard_normal(k).astype(F32) * F32(1e-42)  # subnormal amaxes
    base[5] = rng.standard_normal(k).astype(F32) * F32(1e-39)
    base[6] = rng.uniform(-1, 1, k).astype(F32) * F32(3e38)  # near FLT_MAX
    base[7] = F32(448.0) * F32(2.0 ** -3)                     # amax / 448 a power of two
    base[8] = np.nextafter(F32(448.0 * 2.0 ** 5), F32(np.inf))
    base[9] = F32(57344.0) * F32(2.0 ** 7)
    base[10] = np.nextafter(F32(2.0 ** -126), F32(0))         # largest subnormal
    base[11] = F32(2.0 ** -118)                               # v near 2**-127
    base[12] = np.nan                                         # all NaN: amax 0
    base[13] = np.nextafter(F32(448.0 * 2.0 ** -127), F32(1))
    rows.append(base)
    exps = rng.integers(-140, 128, size=(16, k))
    with np.errstate(over="ignore"):
        rows.append((rng.uniform(0.5, 1.0, (16, k)) * np.exp2(exps.astype(np.float64)))
                    .astype(F32) * rng.choice([-1, 1], (16, k)).astype(F32))
    return np.concatenate(rows)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("k", [32, 96, 70], ids=["k32", "k96", "k70"])
def test_quantize_mxfp8_bits_equal_the_reference(fp8_dtype, k):
    x = special_rows(np.random.default_rng(k), k)
    q, s = jax_fp8.quantize_mxfp8(x, fp8_dtype)
    want_q, want_e = ref_quantize(x, fp8_dtype)
    assert s.dtype == jnp.float8_e8m0fnu and s.shape == (x.shape[0], -(-k // 32))
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), want_e)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    # the edge cases are there: scale exponents 0 and 254, a subnormal v
    assert {0, 254} <= set(np.unique(want_e).tolist())


def test_quantize_mxfp8_16_bit_inputs_and_leading_axes():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 3, 5, 64)) * 30).astype(ml_dtypes.bfloat16)
    q, s = jax_fp8.quantize_mxfp8(x)
    want_q, want_e = ref_quantize(x, E4M3)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), want_e)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))


def test_quantize_mxfp8_refuses_what_it_cannot_take():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jax_fp8.quantize_mxfp8(np.ones((2, 32), np.int32))
    with pytest.raises(ValueError, match=r"\[\.\.\., M, K\]"):
        jax_fp8.quantize_mxfp8(np.ones((32,), F32))
    with pytest.raises(TypeError, match="fp8_dtype"):
        jax_fp8.quantize_mxfp8(np.ones((2, 32), F32), jnp.float8_e8m0fnu)
    with pytest.raises(TypeError, match="fp8_format"):
        jax_fp8.MXFP8BlockScaling(fp8_format="E4M3")


# ----------------------------------------------------------------------------- the GEMM

def dequant(q, e):
    k = q.shape[-1]
    s = np.ldexp(1.0, e.astype(np.int64) - 127)
    return q.astype(np.float64) * np.repeat(s, 32, -1)[..., :k]


def assert_within(out, a, b, out_dtype, coef=None):
    """a [M, K], b [N, K] (float64, dequantized): the bound of the module docstring (or
    another GEMM coefficient `coef`)."""
    e, s = a @ b.T, np.abs(a) @ np.abs(b.T)
    k, u_out = a.shape[1], U_OUT[np.dtype(out_dtype)]
    coef = (k + 4) * U if coef is None else coef
    tol = coef * (1 + u_out) * s + u_out * np.abs(e)
    err = np.abs(np.asarray(out, np.float64) - e)
    assert not (err > tol).any(), f"{(err > tol).sum()} outside the bound"
    return e


@pytest.mark.parametrize("out_dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_forward_and_gradients_within_the_bound(out_dtype):
    rng = np.random.default_rng(2)
    m, k, n = 48, 96, 40
    # per-block magnitudes 2**-6 .. 2**6, so a mixed-up block scale shows
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 7, (m, 1)))).astype(F32)
    w = (rng.standard_normal((k, n)) * np.exp2(rng.integers(-6, 7, (1, n)))).astype(F32)
    g = rng.standard_normal((m, n)).astype(F32)
    recipe = jax_fp8.MXFP8BlockScaling(fp8_format=jax_fp8.Format.HYBRID)
    meta = jax_fp8.Fp8Meta.create(recipe)

    def f(x, w):
        return jax_fp8.fp8_dot_general(x, w, DN, meta, preferred_element_type=out_dtype)[0]

    out, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(jnp.asarray(g, out.dtype))
    deq = lambda a, dt: dequant(*ref_quantize(a, dt))  # noqa: E731
    assert_within(out, deq(x, E4M3), deq(w.T, E4M3), out_dtype)
    g_used = np.asarray(jnp.asarray(g, out.dtype).astype(jnp.float32))
    # dgrad: g [M, N] blocked along N (E5M2 under HYBRID), w [K, N] blocked along N
    assert_within(dx, deq(g_used, E5M2), deq(w, E4M3), np.float32)
    # wgrad: x^T [K, M] and g^T [N, M] blocked along M
    assert_within(dw, deq(x.T, E4M3), deq(g_used.T, E5M2), np.float32)


@pytest.mark.gpu
def test_gpu_gemm_native_or_emulated_within_the_bound(gpu_device):
    """On a GPU: natively where every GPU is a Blackwell (within the tensor cores' bound of
    the block GEMM, tests/kernels/test_block_gemm.py), emulated elsewhere (the reference's
    bound); explain names the one that runs."""
    native, why = mxfp8.native_status()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((256, 512)) * np.exp2(rng.integers(-6, 7, (256, 1)))).astype(F32)
    w = rng.standard_normal((512, 384)).astype(F32)
    meta = jax_fp8.Fp8Meta.create(jax_fp8.MXFP8BlockScaling())

    def f(x, w):
        return jax_fp8.fp8_dot_general(x, w, DN, meta)[0]

    out = helpers.run_on(gpu_device, f, x, w)
    deq = lambda a: dequant(*ref_quantize(a, E4M3))  # noqa: E731
    coef = (2.0 ** -10 + (512 / 32 + 4) * U) if native else None
    assert_within(out, deq(x), deq(w.T), np.float32, coef)
    rows = [r for r in explain.explain(f, jax.device_put(x, gpu_device),
                                       jax.device_put(w, gpu_device)) if r.kind == "gemm"]
    assert [r.lowering for r in rows] == ["mxfp8" if native else "mxfp8 emulated"], (rows, why)


def test_explain_says_emulated_on_this_platform():
    x, w = helpers.rand(0, (64, 64)), helpers.rand(1, (64, 64))
    meta = jax_fp8.Fp8Meta.create(jax_fp8.MXFP8BlockScaling())
    rows = [r for r in explain.explain(
        lambda x, w: jax_fp8.fp8_dot_general(x, w, DN, meta)[0], x, w, platform="cpu")
        if r.kind == "gemm"]
    assert [r.lowering for r in rows] == ["mxfp8 emulated"], rows
    assert "dequantized per 1x32 block" in rows[0].why


# ------------------------------------------------------------ the recipe everywhere else

def test_helpers_recipes_hold_every_registered_recipe():
    assert {type(r) for r in helpers.RECIPES.values()} == set(jax_fp8.recipe.registered())
    assert jax_fp8.recipe.MXFP8BlockScaling is jax_fp8.MXFP8BlockScaling


def test_meta_exports_and_auto_threshold():
    recipe = jax_fp8.MXFP8BlockScaling(fp8_format=jax_fp8.Format.HYBRID)
    meta = jax_fp8.Fp8Meta.create(recipe)
    assert meta.stateless and meta.recipe == recipe
    x, w = helpers.rand(0, (64, 64)), helpers.rand(1, (64, 64))
    f = jax.jit(lambda x, w, m: jax_fp8.fp8_dot_general(x, w, DN, m))
    exp = jax.export.export(f, disabled_checks=jax_fp8.export_disabled_checks())(x, w, meta)
    out, back = jax.export.deserialize(exp.serialize()).call(x, w, meta)
    assert back == meta
    np.testing.assert_array_equal(out, f(x, w, meta)[0])
    # The default decides from the measured table (jax_fp8.fp8_pays); on the CPU that
    # converts every GEMM.
    assert jax_fp8.Fp8Rule(recipe=recipe).min_fp8_flops == "measured"
    auto = jax_fp8.Fp8Rule(recipe=recipe, min_fp8_flops="auto")
    assert auto.min_fp8_flops == recipe.auto_min_fp8_flops


def test_update_refuses_states_and_stateless_meta_refuses_them():
    recipe = jax_fp8.MXFP8BlockScaling()
    states = {"input": jax_fp8.ScalingState.create()}
    with pytest.raises(ValueError, match="MXFP8BlockScaling keeps none"):
        jax_fp8.new_fp8_state(states, states, recipe)
    bad = jax_fp8.Fp8Meta(input=jax_fp8.ScalingState.create(), recipe=recipe)
    with pytest.raises(TypeError, match="must be None for MXFP8BlockScaling"):
        jax_fp8.fp8_dot_general(jnp.ones((4, 32)), jnp.ones((32, 4)), DN, bad)


def test_mxfp8_partitions_on_8_devices():
    results = helpers.run_8_device_worker("mxfp8_worker.py")
    assert results and all(v == "ok" for v in results.values()), results


class PlainMLP(nn.Module):
    """A linen model written without jax_fp8."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(128)(x))
        return nn.Dense(64)(x)


def test_fp8_model_converts_to_mxfp8_and_the_train_state_checkpoints(tmp_path):
    recipe = jax_fp8.MXFP8BlockScaling()
    model = fp8_model(PlainMLP(), jax_fp8.Fp8Rule(recipe=recipe, min_fp8_flops=0))
    x, y = helpers.rand(0, (32, 64)), helpers.rand(1, (32, 64))
    v = jax.jit(model.init)(jax.random.key(0), x)
    assert FP8_COLLECTION not in v      # a recipe without state: only the parameters
    rows = [r for r in explain.explain(lambda v, x: model.apply(v, x), v, x, platform="cpu")
            if r.kind == "gemm"]
    assert [r.lowering for r in rows] == ["mxfp8 emulated"] * 2, rows
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.adam(1e-2),
                                 recipe=recipe)
    step = jax.jit(helpers.mse_fp8_step)
    losses = []
    for _ in range(3):
        state, loss = step(state, x, y)
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "ckpt", state)
    ckptr.wait_until_finished()
    fresh = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.adam(1e-2),
                                 recipe=recipe)
    restored = ckptr.restore(tmp_path / "ckpt",
                             jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh))
    helpers.assert_trees_equal(restored.params, state.params)
    a, la = step(state, x, y)
    b, lb = step(restored, x, y)
    assert float(la) == float(lb)


def test_product_bits_is_the_ieee_float32_product():
    """The primitive behind v = amax * float32(1 / fp8_max): one rounding of the exact
    product, subnormal results included, against NumPy's IEEE float32."""
    from jax_fp8._primitives.quotient import product_bits
    rng = np.random.default_rng(5)
    a = (rng.uniform(1, 2, 4096) * np.exp2(rng.integers(-126, 128, 4096))).astype(F32)
    b = np.array([F32(1) / F32(448), F32(1) / F32(57344), F32(3.0), F32(0.1)], F32)
    b = np.repeat(b, 1024)
    c = np.exp2(rng.integers(-30, 1, 4096)).astype(F32)
    with np.errstate(all="ignore"):
        want = ((a.astype(np.float64) * b * c).astype(F32)).view(U32)
    got = np.asarray(jax.jit(product_bits)(a, b, c))
    np.testing.assert_array_equal(got, want)
    assert (want < 0x800000).any()   # subnormal results are among them
