"""The three recipes through one API: Fp8Meta, fp8_dot_general / fp8_einsum, the linen and
NNX layers and Fp8TrainState; switching a model's recipe is one argument."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import helpers
import jax_fp8
from helpers import rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8Einsum, Fp8TrainState, nnx as fnnx

RECIPES = helpers.RECIPES
DN = (((1,), (0,)), ((), ()))


def _mlp(recipe):
    dg = functools.partial(Fp8DotGeneral, recipe=recipe)
    return nn.Sequential([nn.Dense(256, dot_general_cls=dg), nn.gelu,
                          nn.Dense(128, dot_general_cls=dg)])


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_same_model_trains_with_each_recipe(name):
    recipe = RECIPES[name]
    model = _mlp(recipe)
    x, y = rand(0, (64, 128)), rand(1, (64, 128))
    v = model.init(jax.random.key(0), x)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.adam(1e-2),
                                 recipe=recipe)
    assert (FP8_COLLECTION in v) == (name == "delayed")

    step = jax.jit(lambda state: helpers.mse_fp8_step(state, x, y))

    losses = []
    for _ in range(25):
        state, val = step(state)
        losses.append(float(val))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.1 * losses[0], losses
    # Close to the float32 model trained the same way (FP8 rounding only).
    val = _float32_loss()
    assert abs(losses[-1] - val) < 0.3 * val + 1e-3


@functools.cache
def _float32_loss():
    """The last of 25 losses of the model without FP8, trained as the test trains the FP8
    one: the same for every recipe, computed once."""
    x, y = rand(0, (64, 128)), rand(1, (64, 128))
    plain = nn.Sequential([nn.Dense(256), nn.gelu, nn.Dense(128)])
    tx = optax.adam(1e-2)
    params = plain.init(jax.random.key(0), x)["params"]

    @jax.jit
    def step(params, opt):
        val, g = jax.value_and_grad(lambda p: jnp.mean((plain.apply({"params": p}, x) - y) ** 2))(
            params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, val

    opt = tx.init(params)
    for _ in range(25):
        params, opt, val = step(params, opt)
    return float(val)


@pytest.mark.parametrize("name", ["current", "block", "mxfp8"])
def test_stateless_metas_through_the_functional_api(name):
    recipe = RECIPES[name]
    meta = jax_fp8.Fp8Meta.create(recipe)
    assert meta.stateless and jax.tree.leaves(meta) == []
    x, w = rand(0, (256, 128)), rand(1, (128, 256))
    out, back = jax.jit(lambda x, w: jax_fp8.fp8_dot_general(x, w, DN, meta))(x, w)
    assert back == meta
    np.testing.assert_allclose(out, x @ w, rtol=0.1, atol=0.1 * float(jnp.max(jnp.abs(x @ w))))
    eout, _ = jax_fp8.fp8_einsum("md,dn->mn", x, w, meta)
    np.testing.assert_array_equal(eout, out)
    direct = jax_fp8.gemm.scaled_dot.scaled_dot_general(x, w, DN, recipe)
    np.testing.assert_array_equal(out, direct)


@pytest.mark.parametrize("name", ["current", "block", "mxfp8"])
def test_einsum_module_and_nnx_layers_take_stateless_recipes(name):
    recipe = RECIPES[name]

    class Proj(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param("kernel", nn.initializers.normal(0.05), (128, 256))
            return Fp8Einsum(recipe=recipe)("bd,df->bf", x, k)

    x = rand(0, (128, 128))
    v = Proj().init(jax.random.key(0), x)
    assert FP8_COLLECTION not in v
    assert Proj().apply(v, x).shape == (128, 256)
    lin = fnnx.Fp8Linear(128, 256, recipe=recipe, rngs=nnx.Rngs(0))
    assert not jax.tree.leaves(fnnx.fp8_state(lin))
    loss, grads = fnnx.fp8_value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))(lin, x)
    assert np.isfinite(float(loss)) and jax.tree.leaves(grads)
    fnnx.update_fp8(lin, grads, recipe)     # nothing to update, no error


def test_delayed_states_under_a_stateless_recipe_are_an_error():
    model = _mlp(RECIPES["delayed"])
    v = model.init(jax.random.key(0), jnp.ones((2, 128)))
    with pytest.raises(ValueError, match="keeps none"):
        Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(0.1),
                             recipe=RECIPES["block"])


def test_stateless_meta_exports_with_its_recipe():
    meta = jax_fp8.Fp8Meta.create(jax_fp8.Float8BlockScaling(fp8_format=jax_fp8.Format.HYBRID))
    x, w = rand(0, (128, 128)), rand(1, (128, 128))
    f = jax.jit(lambda x, w, m: jax_fp8.fp8_dot_general(x, w, DN, m))
    exp = jax.export.export(f, disabled_checks=jax_fp8.export_disabled_checks())(x, w, meta)
    back = jax.export.deserialize(exp.serialize())
    out, m2 = back.call(x, w, meta)
    assert m2 == meta
    np.testing.assert_array_equal(out, f(x, w, meta)[0])
