"""Contracts of the FP8 state with JAX's and Flax's machinery, linen and NNX:
`frozen_scales` and jit's cache, NNX's ``nnx.merge`` from leaves, ``jax.export`` of the
packed state, restoring into a changed model, and NNX under ``jax.jit``."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
from helpers import assert_trees_equal, rand
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, nnx as fnnx

RECIPE = jax_fp8.DelayedScaling(history_len=4)

pytestmark = pytest.mark.usefixtures("on_cpu")


class MLP(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, x):
        dg = functools.partial(Fp8DotGeneral, recipe=RECIPE)
        for _ in range(self.layers - 1):
            x = nn.relu(nn.Dense(16, dot_general_cls=dg)(x))
        return nn.Dense(4, dot_general_cls=dg)(x)


X, Y = rand(0, (16, 8)), rand(1, (16, 4))


def _linen_state(model=None, pack_fp8=True, recipe=RECIPE):
    model = MLP() if model is None else model
    return Fp8TrainState.create(apply_fn=model.apply, variables=model.init(jax.random.key(0), X),
                                tx=optax.sgd(1e-2), recipe=recipe, pack_fp8=pack_fp8)


def _linen_step(state):
    def loss_fn(params, fp8):
        return jnp.mean((state.apply_model(params, fp8, X) - Y) ** 2)
    return state.apply_gradients(grads=state.value_and_grad(loss_fn)()[1])


class Net(nnx.Module):
    def __init__(self, rngs, layers=2):
        self.layers = nnx.List([fnnx.Fp8Linear(8, 8, recipe=RECIPE, rngs=rngs)
                                for _ in range(layers - 1)])
        self.out = fnnx.Fp8Linear(8, 4, recipe=RECIPE, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.out(x)


def _nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


# ----------------------------------------------------------------- frozen_scales and jit

@pytest.mark.parametrize("first", ["inside", "outside"])
def test_linen_frozen_scales_is_part_of_the_jit_cache_key(first):
    state = _linen_state()
    step = jax.jit(_linen_step)
    if first == "outside":
        step(state)                                  # traced (and cached) outside
    with jax_fp8.frozen_scales():
        frozen = step(state)
    thawed = step(state)
    assert_trees_equal(frozen.fp8, state.fp8)        # inside: frozen, whatever was traced
    assert not np.array_equal(np.asarray(thawed.fp8.groups[0].scale),
                              np.asarray(state.fp8.groups[0].scale)) or \
        not np.array_equal(np.asarray(thawed.fp8.groups[0].amax_history),
                           np.asarray(state.fp8.groups[0].amax_history))


@pytest.mark.parametrize("first", ["inside", "outside"])
def test_nnx_frozen_scales_is_part_of_the_jit_cache_key(first):
    @nnx.jit
    def step(model, opt):
        _, grads = fnnx.fp8_value_and_grad(_nnx_loss)(model, X, Y)
        opt.update(model, grads)

    def fresh():
        model = Net(nnx.Rngs(0))
        return model, fnnx.Fp8Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param, recipe=RECIPE)

    if first == "outside":
        step(*fresh())
    model, opt = fresh()
    before = jax.tree.map(jnp.copy, fnnx.fp8_state(model))
    with jax_fp8.frozen_scales():
        step(model, opt)
    assert_trees_equal(fnnx.fp8_state(model), before)
    step(model, opt)
    fnnx.check_fp8_updated(model)


# ------------------------------------------------------------------- NNX under jax.jit

def test_nnx_step_under_jax_jit_is_named_by_check_fp8_updated():
    """`jax.jit` in place of `nnx.jit`: Flax drops the step's changes to the model (the
    parameters do not train either); check_fp8_updated names that cause and nnx.jit."""
    model = Net(nnx.Rngs(0))
    opt = fnnx.Fp8Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param, recipe=RECIPE)
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))

    @jax.jit
    def step(model, opt):
        _, grads = fnnx.fp8_value_and_grad(_nnx_loss)(model, X, Y)
        opt.update(model, grads)

    for _ in range(2):
        step(model, opt)
    assert_trees_equal(nnx.state(model, nnx.Param), params)      # Flax's own behaviour
    with pytest.raises(ValueError, match=r"was ever updated.*`jax\.jit` instead of "
                                         r"`nnx\.jit`.*@nnx\.jit"):
        fnnx.check_fp8_updated(model)
