"""Every spelling of a GEMM a matched module can use is converted or reported: ``x @ w``,
``jnp.matmul``, ``jnp.dot`` and ``x.dot(w)`` of a module's weight run as the FP8
``dot_general`` with the same result, bit for bit the module written with jax_fp8's layers
(linen, NNX, Equinox); a matrix product that broadcasts its batch axes, which no FP8 GEMM
takes, runs as written and is reported (Fp8ConversionWarning, explain's reason)."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
from helpers import assert_trees_equal, rand, train_steps
from jax_fp8.devtools import explain
from jax_fp8.flax import (
    FP8_COLLECTION,
    Fp8ConversionWarning,
    Fp8DotGeneral,
    Fp8Rule,
    Fp8TrainState,
    fp8_model,
    nnx as fnnx,
)
from jax_fp8.interception import KEPT_SCOPES

RECIPE = jax_fp8.DelayedScaling(history_len=4)
RULE = Fp8Rule(recipe=RECIPE, min_fp8_flops=0)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
KEY = jax.random.key(0)


def record(fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in caught if issubclass(w.category, Fp8ConversionWarning)]


SPELLINGS = {
    "x @ w": lambda x, w: x @ w,
    "jnp.matmul": lambda x, w: jnp.matmul(x, w),
    "jnp.dot": lambda x, w: jnp.dot(x, w),
    "x.dot(w)": lambda x, w: x.dot(w),
    "3-d x @ w": lambda x, w: (x.reshape(2, -1, x.shape[-1]) @ w).reshape(-1, w.shape[-1]),
    "w.T @ x.T": lambda x, w: (w.T @ x.T).T,
}


def _hand(x, w, spelling):
    """The same GEMM written with jax_fp8's layer: the weight's state, `w_fp8`."""
    if spelling == "w.T @ x.T":
        return DG(name="w_fp8")(x.T, w.T, (((0,), (1,)), ((), ()))).T.T
    if spelling == "3-d x @ w":
        x3 = x.reshape(2, -1, x.shape[-1])
        return DG(name="w_fp8")(x3, w, (((2,), (0,)), ((), ()))).reshape(-1, w.shape[-1])
    return DG(name="w_fp8")(x, w, (((1,), (0,)), ((), ())))


class Proj(nn.Module):
    spelling: str
    by_hand: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (32, 16))
        h = nn.relu(_hand(x, w, self.spelling) if self.by_hand
                    else SPELLINGS[self.spelling](x, w))
        return nn.Dense(8, dot_general_cls=DG if self.by_hand else None)(h)


def _train(model, variables, x, y):
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables,
                                 tx=optax.sgd(1e-2), recipe=RECIPE)
    return train_steps(state, x, y, steps=2)


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_linen_matrix_products_equal_the_hand_written_layer(spelling):
    x, y = rand(0, (16, 32)), rand(1, (16, 8))
    converted, by_hand = fp8_model(Proj(spelling), RULE), Proj(spelling, by_hand=True)
    v, vh = converted.init(KEY, x), by_hand.init(KEY, x)
    assert_trees_equal(v, vh)
    assert sorted(v[FP8_COLLECTION]) == ["Dense_0", "w_fp8"]
    out, caught = record(converted.apply, v, x)
    assert not caught, caught
    np.testing.assert_array_equal(out, by_hand.apply(vh, x))
    (losses, state), (losses_h, state_h) = _train(converted, v, x, y), _train(by_hand, vh, x, y)
    np.testing.assert_array_equal(losses, losses_h)
    assert_trees_equal(state.params, state_h.params)
    assert_trees_equal(state.fp8, state_h.fp8)
    jax_fp8.check_fp8_updated(state.fp8)


class NnxProj(nnx.Module):
    def __init__(self, rngs, by_hand=False):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (32, 16)))
        if by_hand:
            self.w_fp8 = fnnx.Fp8DotGeneral(RECIPE)
        self.by_hand = by_hand

    def __call__(self, x):
        if self.by_hand:
            return self.w_fp8(x, self.w[...], (((1,), (0,)), ((), ())))
        return x @ self.w[...]


def test_nnx_at_of_a_param_equals_the_hand_written_layer():
    x, y = rand(0, (16, 32)), rand(1, (16, 16))
    model, caught = record(fp8_model, NnxProj(nnx.Rngs(0)), RULE, x)
    assert not caught and isinstance(model.w_fp8, fnnx.Fp8DotGeneral)
    by_hand = NnxProj(nnx.Rngs(0), by_hand=True)
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))
    np.testing.assert_array_equal(model(x), by_hand(x))

    def train(m):
        opt = fnnx.Fp8Optimizer(m, optax.sgd(1e-2), wrt=nnx.Param, recipe=RECIPE)
        loss, grads = fnnx.fp8_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(m)
        opt.update(m, grads)
        return loss

    np.testing.assert_array_equal(train(model), train(by_hand))
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))


def test_equinox_at_of_a_weight_runs_as_the_fp8_dot_general():
    eqx = pytest.importorskip("equinox")
    from jax_fp8 import equinox as jfe

    class Own(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    w, x = rand(2, (32, 16)), rand(3, (16, 32))
    model = jfe.fp8_model(Own(w), RULE)
    assert [p for p, _ in jfe.fp8_states(model)]
    want, _ = jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())),
                                      jax_fp8.Fp8Meta.create(RECIPE))
    np.testing.assert_array_equal(model(x), want)


class Broadcast(nn.Module):
    """A batched product whose batch axes broadcast (weight [1, K, N], activations
    [2, M, K]): no FP8 GEMM takes it."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (1, 32, 16))
        return jnp.matmul(x.reshape(2, -1, 32), w)


def test_a_broadcasting_product_runs_as_written_and_is_reported():
    x = rand(0, (16, 32))
    model = fp8_model(Broadcast(), RULE)
    variables = model.init(KEY, x)
    assert FP8_COLLECTION not in variables
    out, caught = record(model.apply, variables, x)
    assert len(caught) == 1, caught
    for part in ("root module (Broadcast)", "matmul", "broadcasts", "(2, 8, 32)"):
        assert part in caught[0], caught[0]
    np.testing.assert_array_equal(out, Broadcast().apply(variables, x))
    _, caught = record(model.apply, variables, x)
    assert not caught                                    # once per model
    rows = [r for r in explain.explain(model.apply, variables, x) if r.kind == "gemm"]
    assert [r.why for r in rows] == [KEPT_SCOPES["fp8_model_form"]]


def test_the_products_are_jax_s_own_outside_a_converted_call():
    """The converters replace jnp.matmul / jnp.dot (and what @ calls) only while a
    converted model runs."""
    from jax_fp8 import _compat

    contractions = _compat.numpy_contractions()
    x = rand(0, (16, 32))
    fp8_model(Proj("x @ w"), RULE).init(KEY, x)
    assert jnp.matmul is contractions.matmul and jnp.dot is contractions.dot
    assert jnp.matmul.__module__.startswith("jax")


def test_linen_embed_attend_stays_as_it_is():
    """nn.Embed.attend (a jnp.dot with the embedding table, the tied output projection)
    is left as it is, as documented: no state, no warning, the unconverted numbers."""
    class Tied(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(64, 32)
            h = nn.Dense(32)(embed(tokens))
            return embed.attend(h)

    tokens = jnp.arange(16) % 64
    model = fp8_model(Tied(), RULE)
    variables = model.init(KEY, tokens)
    assert list(variables[FP8_COLLECTION]) == ["Dense_0"]
    out, caught = record(model.apply, variables, tokens)
    assert not caught, caught
    rows = [r for r in explain.explain(model.apply, variables, tokens) if r.kind == "gemm"]
    assert sorted(r.lowering for r in rows) == ["float32", "fp8"], rows
