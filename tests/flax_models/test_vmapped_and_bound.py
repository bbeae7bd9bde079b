"""Two ways a user reaches the model inside a differentiated loss besides `state.apply_model`
on the whole batch, both against that reference (linen, the FP8 state packed or not): a loss
that ``jax.vmap``s ``state.apply_model`` / ``model.apply`` over microbatches with the FP8
state closed over (a shared meta under vmap stages the max over the batch), and a module
bound with ``model.bind(variables)`` inside the loss. The loss is the same mean as the
whole batch's, so the gradient that reaches each GEMM is the same tensor: every state
records the same amax (the input's and the kernel's bit for bit)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_fp8
from helpers import rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8Rule, Fp8TrainState, fp8_model
from jax_fp8.state import is_state

RECIPE = jax_fp8.DelayedScaling(history_len=4)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, dot_general_cls=DG)(nn.relu(nn.Dense(16, dot_general_cls=DG)(x)))


class Twice(nn.Module):
    """One Dense applied twice in one call (its uses thread)."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(8, dot_general_cls=DG)
        return dense(nn.relu(dense(x)))


class Own(nn.Module):
    """A module's own GEMMs, converted by fp8_model (a weight's state, `w_fp8`)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (16, 8))
        return jnp.einsum("bd,dh->bh", nn.relu(nn.Dense(16)(x)), w)


MODELS = {"mlp": Mlp(), "twice": Twice(), "converted": fp8_model(Own(), Fp8Rule(recipe=RECIPE))}
X, Y = rand(0, (16, 8), 2.0), rand(1, (16, 8))


def _state(name, pack_fp8):
    model = MODELS[name]
    return model, Fp8TrainState.create(apply_fn=model.apply, tx=optax.sgd(1e-2),
                                       variables=model.init(jax.random.key(0), X),
                                       recipe=RECIPE, pack_fp8=pack_fp8)


def _newest(state):
    tree = jax_fp8.unpack_states(state.fp8)
    return {jax.tree_util.keystr(p): np.asarray(s.amax_history[..., -1])
            for p, s in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]
            if is_state(s)}


def _step(state, loss_fn, *args):
    _, grads = jax.jit(state.value_and_grad(loss_fn))(*args)
    return _newest(state.apply_gradients(grads=grads))


def _same_records(got, want):
    assert got.keys() == want.keys() and got
    for path in want:
        assert want[path] > 0, path
        if path.endswith("['grad']"):   # the same gradient, from GEMMs batched otherwise
            np.testing.assert_allclose(got[path], want[path], rtol=1e-6, err_msg=path)
        else:
            np.testing.assert_array_equal(got[path], want[path], err_msg=path)


def _whole(state):
    def loss_fn(params, fp8, x, y):
        return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2)
    return _step(state, loss_fn, X, Y)


@pytest.mark.parametrize("pack_fp8", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("how", ["apply_model", "model.apply", "model.apply mutable"])
def test_a_loss_that_vmaps_the_model_over_microbatches(name, pack_fp8, how):
    model, state = _state(name, pack_fp8)
    xs, ys = X.reshape(4, 4, 8), Y.reshape(4, 4, 8)

    def apply(params, fp8, x):
        if how == "apply_model":
            return state.apply_model(params, fp8, x)
        variables = {"params": params, FP8_COLLECTION: fp8}
        if how == "model.apply":
            return model.apply(variables, x)
        return model.apply(variables, x, mutable=[FP8_COLLECTION])[0]

    def loss_fn(params, fp8, xs, ys):
        per = jax.vmap(lambda x, y: jnp.mean((apply(params, fp8, x) - y) ** 2))(xs, ys)
        return jnp.mean(per)

    _same_records(_step(state, loss_fn, xs, ys), _whole(state))


@pytest.mark.parametrize("pack_fp8", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mutable", [False, True])
def test_a_module_bound_inside_the_loss(name, pack_fp8, mutable):
    model, state = _state(name, pack_fp8)

    def loss_fn(params, fp8, x, y):
        variables = {"params": params, FP8_COLLECTION: fp8}
        bound = model.bind(variables, mutable=[FP8_COLLECTION] if mutable else False)
        return jnp.mean((bound(x) - y) ** 2)

    _same_records(_step(state, loss_fn, X, Y), _whole(state))


@pytest.mark.parametrize("pack_fp8", [True, False], ids=["packed", "unpacked"])
def test_a_module_bound_inside_the_loss_and_called_twice(pack_fp8):
    """Two calls of one bound module on one FP8 state: with the collection mutable they
    thread (the max over both, as one call on both halves); read-only, the second use is
    refused naming the fix, as for two applies."""
    model, state = _state("mlp", pack_fp8)
    both = jnp.concatenate([X, 3 * X])

    def whole(params, fp8):
        return jnp.mean(state.apply_model(params, fp8, both) ** 2)

    def twice(mutable):
        def loss_fn(params, fp8):
            bound = model.bind({"params": params, FP8_COLLECTION: fp8},
                               mutable=[FP8_COLLECTION] if mutable else False)
            return jnp.mean(jnp.concatenate([bound(X), bound(3 * X)]) ** 2)
        return loss_fn

    _same_records(_step(state, twice(True)), _step(state, whole))
    with pytest.raises(ValueError, match="already given to another FP8 op"):
        _step(state, twice(False))
