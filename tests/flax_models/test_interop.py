"""jax_fp8.flax.interop: Flax fp8_ops variables and Transformer Engine's [L, N] layout."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops

import jax_fp8
from helpers import rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, interop

L = 8
RECIPE = jax_fp8.DelayedScaling(history_len=L)
FLAX_DG = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=L)
OUR_DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
IS_STATE = lambda x: isinstance(x, jax_fp8.ScalingState)  # noqa: E731


# Conversion is backend-independent; run on CPU, where the tiny reference models
# (widths 4..16) train deterministically. (On an H200 with jax 0.11.2, XLA's Triton FP8
# GEMMs turned these 8-wide models -- Flax's own fp8_ops one too -- NaN after two
# steps; realistic widths, multiples of 16, train fine there.)
pytestmark = pytest.mark.usefixtures("on_cpu")


class MLP(nn.Module):
    dot_general_cls: object

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, dot_general_cls=self.dot_general_cls)(x))
        return nn.Dense(4, dot_general_cls=self.dot_general_cls)(x)


@functools.cache
def _flax_trained(steps=3):
    """Variables of Flax's own FP8 model after a few steps (overwrite-with-gradient)."""
    model = MLP(FLAX_DG)
    v = jax.jit(model.init)(jax.random.key(0), rand(0, (8, 8)))

    @jax.jit
    def step(v, x):
        g = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)
        params = jax.tree.map(lambda p, d: p - 1e-3 * d, v["params"], g["params"])
        return {"params": params, interop.FLAX_COLLECTION: g[interop.FLAX_COLLECTION]}

    for i in range(steps):
        v = step(v, rand(10 + i, (8, 8), 1.0 + i))
    return model, v


def _flax_next_dequant_scale(h, s, dtype):
    """The dequantization scale Flax computes (and uses) from a stored history/scale."""
    new_scale, _ = fp8_ops.update_fp8_meta(jnp.zeros(()), dtype, s, h)
    return new_scale


FLAX_TENSORS = (("input", jnp.float8_e4m3fn), ("kernel", jnp.float8_e4m3fn),
                ("output_grad", jnp.float8_e5m2))


def test_from_flax_reproduces_flax_scales_and_outputs():
    flax_model, fv = _flax_trained()
    ours = interop.from_flax(fv)
    assert set(ours) == {"params", FP8_COLLECTION}
    meta = ours[FP8_COLLECTION]["Dense_0"]["Fp8DotGeneral_0"]
    assert meta["grad"].fp8_dtype == jnp.float8_e5m2 and meta["input"].amax_history.shape == (L,)
    for dense in ("Dense_0", "Dense_1"):
        theirs = fv[interop.FLAX_COLLECTION][dense]["Fp8DirectDotGeneralOp_0"]
        mine = ours[FP8_COLLECTION][dense]["Fp8DotGeneral_0"]
        for (name, dtype), our_name in zip(FLAX_TENSORS, ("input", "kernel", "grad")):
            want = _flax_next_dequant_scale(theirs[f"{name}_amax_history"],
                                            theirs[f"{name}_scale"], dtype)
            np.testing.assert_allclose(mine[our_name].scale_inv, want[0], rtol=2e-7)
            np.testing.assert_allclose(mine[our_name].scale, 1 / want[0], rtol=2e-7)
            # Flax's newest amax (slot 0) is our newest (last slot); slot 1 dropped.
            h = np.asarray(theirs[f"{name}_amax_history"])
            np.testing.assert_array_equal(mine[our_name].amax_history,
                                          np.concatenate([[0.0], h[2:], h[:1]]))
    x = rand(99, (8, 8), 3.0)
    flax_out = jax.jit(flax_model.apply)(fv, x)
    our_out = jax.jit(MLP(OUR_DG).apply)(ours, x)
    assert float(jnp.linalg.norm(our_out - flax_out) / jnp.linalg.norm(flax_out)) < 1e-2


@functools.cache
def _our_trained(steps=3):
    model = MLP(OUR_DG)
    v = jax.jit(model.init)(jax.random.key(0), rand(0, (8, 8)))

    @jax.jit
    def step(v, x):
        def loss(params, fp8):
            out, _ = model.apply({"params": params, FP8_COLLECTION: fp8}, x,
                                 mutable=[FP8_COLLECTION])
            return jnp.sum(out ** 2)
        g, fg = jax.grad(loss, argnums=(0, 1))(v["params"], v[FP8_COLLECTION])
        params = jax.tree.map(lambda p, d: p - 1e-3 * d, v["params"], g)
        return {"params": params,
                FP8_COLLECTION: jax_fp8.new_fp8_state(v[FP8_COLLECTION], fg, RECIPE)}

    for i in range(steps):
        v = step(v, rand(10 + i, (8, 8), 1.0 + i))
    return model, v


def test_to_flax_gives_flax_our_scales_and_outputs():
    model, ours = _our_trained()
    fv = interop.to_flax(ours)
    assert set(fv) == {"params", interop.FLAX_COLLECTION}
    for dense in ("Dense_0", "Dense_1"):
        theirs = fv[interop.FLAX_COLLECTION][dense]["Fp8DirectDotGeneralOp_0"]
        mine = ours[FP8_COLLECTION][dense]["Fp8DotGeneral_0"]
        for (name, dtype), our_name in zip(FLAX_TENSORS, ("input", "kernel", "grad")):
            assert theirs[f"{name}_amax_history"].shape == (L,)
            assert theirs[f"{name}_scale"].shape == (1,)
            got = _flax_next_dequant_scale(theirs[f"{name}_amax_history"],
                                           theirs[f"{name}_scale"], dtype)
            np.testing.assert_allclose(got[0], mine[our_name].scale_inv, rtol=2e-7)
    x = rand(99, (8, 8), 3.0)
    our_out = jax.jit(model.apply)(ours, x)
    flax_out = jax.jit(MLP(FLAX_DG).apply)(fv, x)
    assert float(jnp.linalg.norm(our_out - flax_out) / jnp.linalg.norm(our_out)) < 1e-2
    # And the Flax model keeps training from there.
    g = jax.jit(jax.grad(lambda v: jnp.sum(MLP(FLAX_DG).apply(v, x) ** 2)))(fv)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))


def test_roundtrips():
    _, ours = _our_trained()
    back = interop.from_flax(interop.to_flax(ours))
    for a, b in zip(jax.tree.leaves(ours[FP8_COLLECTION], is_leaf=IS_STATE),
                    jax.tree.leaves(back[FP8_COLLECTION], is_leaf=IS_STATE)):
        assert a.fp8_dtype == b.fp8_dtype
        np.testing.assert_array_equal(a.amax_history, b.amax_history)
        np.testing.assert_allclose(b.scale, a.scale, rtol=2e-7)
        np.testing.assert_allclose(b.scale_inv, a.scale_inv, rtol=2e-7)
    jax.tree.map(np.testing.assert_array_equal, back["params"], ours["params"])
    # Flax -> ours -> Flax: Flax computes the same scales from the result.
    _, fv = _flax_trained()
    again = interop.to_flax(interop.from_flax(fv))
    for dense in ("Dense_0", "Dense_1"):
        t0 = fv[interop.FLAX_COLLECTION][dense]["Fp8DirectDotGeneralOp_0"]
        t1 = again[interop.FLAX_COLLECTION][dense]["Fp8DirectDotGeneralOp_0"]
        for name, dtype in FLAX_TENSORS:
            h0, h1 = t0[f"{name}_amax_history"], t1[f"{name}_amax_history"]
            # Newest and the L-2 entries Flax keeps match; slot 1 (dropped next) may not.
            np.testing.assert_array_equal(np.asarray(h1)[[0, *range(2, L)]],
                                          np.asarray(h0)[[0, *range(2, L)]])
            np.testing.assert_allclose(
                _flax_next_dequant_scale(h1, t1[f"{name}_scale"], dtype),
                _flax_next_dequant_scale(h0, t0[f"{name}_scale"], dtype), rtol=2e-7)


def test_flax_stacked_scan_layout_and_fresh_state():
    n = 3
    h = jnp.abs(rand(0, (n, L)))
    flax_mod = {f"{p}_{s}": (h if s == "amax_history" else jnp.full((n, 1), 0.5))
                for p in ("input", "kernel", "output_grad") for s in ("amax_history", "scale")}
    ours = interop.from_flax({"layers": {"Fp8DirectDotGeneralOp_0": flax_mod}})
    st = ours["layers"]["Fp8DotGeneral_0"]["input"]
    assert st.amax_history.shape == (n, L) and st.scale.shape == (n,)
    np.testing.assert_allclose(st.scale, 448.0 / jnp.max(h, axis=-1), rtol=1e-6)
    back = interop.to_flax(ours)["layers"]["Fp8DirectDotGeneralOp_0"]
    assert back["input_scale"].shape == (n, 1)
    # A fresh state (zero history, scale 1) maps to Flax's fresh state and back.
    fresh = {"Fp8DotGeneral_0": {k: v for k, v in zip(
        ("input", "kernel", "grad"), jax.tree.leaves(
            jax_fp8.Fp8Meta.create(RECIPE), is_leaf=IS_STATE))}}
    f = interop.to_flax(fresh)["Fp8DirectDotGeneralOp_0"]
    np.testing.assert_array_equal(f["input_amax_history"], np.zeros(L))
    np.testing.assert_array_equal(f["output_grad_scale"], [1.0])
    with pytest.raises(ValueError, match="input_scale"):
        bad = dict(flax_mod, input_scale=jnp.ones((n,)))
        interop.from_flax({"m": bad})


def test_transformer_engine_layout_roundtrip():
    tree = {"a": jax_fp8.Fp8Meta.create(RECIPE),
            "stack": jax_fp8.ScalingState.create((2, 3), L, jnp.float8_e5m2)}
    tree = jax.tree.map(lambda x: x + rand(int(x.size), x.shape) ** 2, tree)
    te = interop.to_te(tree)
    n = 3 + 6
    assert te["amax_history"].shape == (L, n) and te["scale"].shape == (n,)
    # History on axis 0: column i is tensor i's history (tree order).
    np.testing.assert_array_equal(te["amax_history"][:, 0], tree["a"].grad.amax_history)
    np.testing.assert_array_equal(te["amax_history"][:, 3 + 4],
                                  tree["stack"].amax_history[1, 1])
    np.testing.assert_array_equal(te["scale_inv"][3:], tree["stack"].scale_inv.reshape(-1))
    back = interop.from_te(**te, like=tree)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    stacked = interop.from_te(te["amax_history"], te["scale"], fp8_dtype=jnp.float8_e4m3fn)
    assert stacked.amax_history.shape == (n, L)
    np.testing.assert_allclose(stacked.scale_inv, 1 / te["scale"], rtol=1e-7)
    # The stacked state updates with one fused call like any other.
    new = jax_fp8.update_states(stacked, jnp.ones((n,)), recipe=RECIPE)
    assert new.amax_history.shape == (n, L)
    with pytest.raises(ValueError, match="history length"):
        interop.to_te([jax_fp8.ScalingState.create((), 4), jax_fp8.ScalingState.create((), 5)])
    with pytest.raises(ValueError, match="N = "):
        interop.from_te(te["amax_history"][:, :4], te["scale"][:4], like=tree)
