"""One rule for a layer used several times in one step, packed FP8 state (Fp8TrainState's
default) and unpacked alike: the uses' amaxes combine by max, or the step is refused at
trace time naming the fix; never the sum."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_fp8
from helpers import rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState
from jax_fp8.state import is_state

RECIPE = jax_fp8.DelayedScaling(history_len=4)
REUSED = r"already given to another FP8 op.*apply it once"
LOOPED = r"is differentiated but closed over by a `{loop}` body.*combine_fp8_grads"

pytestmark = pytest.mark.usefixtures("on_cpu")


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=RECIPE))(x)


class Twice(nn.Module):
    """The layer called twice inside one apply: it threads its state (max)."""

    @nn.compact
    def __call__(self, x1, x2):
        dense = nn.Dense(8, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=RECIPE))
        return dense(x1), dense(x2)


X1, X2 = rand(0, (4, 8)), rand(1, (4, 8), 3.0)


def _state(pack_fp8, model=None):
    model = Net() if model is None else model
    args = (X1,) if isinstance(model, Net) else (X1, X2)
    return Fp8TrainState.create(apply_fn=model.apply,
                                variables=model.init(jax.random.key(0), *args),
                                tx=optax.sgd(0.1), recipe=RECIPE, pack_fp8=pack_fp8)


def _staged(fp8_grads):
    return {jax.tree_util.keystr(p): np.asarray(a) for p, a in
            jax.tree_util.tree_flatten_with_path(jax_fp8.amax_cotangents(
                jax_fp8.unpack_states(fp8_grads)
                if not isinstance(fp8_grads, jax_fp8.PackedStates) else fp8_grads))[0]}


@pytest.mark.parametrize("pack_fp8", [True, False])
@pytest.mark.parametrize("how", ["apply_model", "model.apply"])
def test_two_applications_in_one_loss_are_refused(pack_fp8, how):
    state = _state(pack_fp8)

    def apply(p, f, x):
        if how == "apply_model":
            return state.apply_model(p, f, x)
        return Net().apply({"params": p, FP8_COLLECTION: f}, x)

    def loss_fn(p, f):
        return jnp.sum(apply(p, f, X1)) + jnp.sum(apply(p, f, X2))

    with pytest.raises(ValueError, match=REUSED):
        jax.jit(lambda s: s.value_and_grad(loss_fn)())(state)


@pytest.mark.parametrize("pack_fp8", [True, False])
def test_two_calls_inside_one_apply_stage_the_max(pack_fp8):
    state = _state(pack_fp8, Twice())

    def loss_fn(p, f):
        a, b = state.apply_model(p, f, X1, X2)
        return jnp.sum(a) + jnp.sum(b)

    _, grads = jax.jit(lambda s: s.value_and_grad(loss_fn)())(state)
    staged = jax_fp8.amax_cotangents(jax_fp8.unpack_states(grads[FP8_COLLECTION])
                                     if not pack_fp8 else grads[FP8_COLLECTION])
    got = jax.tree.leaves(staged)
    # The input's amax: the max of the two calls' inputs, not their sum.
    want = max(float(jnp.max(jnp.abs(X1))), float(jnp.max(jnp.abs(X2))))
    assert want in [float(v) for g in got for v in np.ravel(g)]
    assert float(jnp.max(jnp.abs(X1))) + float(jnp.max(jnp.abs(X2))) not in \
        [float(v) for g in got for v in np.ravel(g)]


@pytest.mark.parametrize("pack_fp8", [True, False])
@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
@pytest.mark.parametrize("how", ["apply_model", "model.apply"])
def test_a_microbatch_loop_inside_the_loss_is_refused(pack_fp8, loop, how):
    """A loss that loops over microbatches, the FP8 state closed over by the body and
    differentiated outside it: JAX would sum the iterations' amaxes."""
    state = _state(pack_fp8)
    xs = jnp.stack([X1, X2])

    def apply(p, f, x):
        if how == "apply_model":
            return state.apply_model(p, f, x)
        return Net().apply({"params": p, FP8_COLLECTION: f}, x)

    def loss_fn(p, f):
        if loop == "scan":
            return jax.lax.scan(lambda c, x: (c + jnp.sum(apply(p, f, x)), None), 0.0, xs)[0]
        return jax.lax.fori_loop(0, 2, lambda i, c: c + jnp.sum(apply(p, f, xs[i])), 0.0)

    with pytest.raises(ValueError, match=LOOPED.format(loop=loop)):
        jax.jit(lambda s: s.value_and_grad(loss_fn)())(state)


@pytest.mark.parametrize("pack_fp8", [True, False])
def test_a_microbatch_loop_differentiating_each_microbatch_stages_the_max(pack_fp8):
    state = _state(pack_fp8)
    xs = jnp.stack([X1, X2])

    def loss_fn(p, f, x):
        return jnp.sum(state.apply_model(p, f, x))

    def body(acc, x):
        _, g = state.value_and_grad(loss_fn)(x)
        return jax_fp8.combine_fp8_grads(acc, g[FP8_COLLECTION]), None

    zeros = jax.tree.map(jnp.zeros_like, state.value_and_grad(loss_fn)(X1)[1][FP8_COLLECTION])
    acc = jax.jit(lambda s: jax.lax.scan(body, zeros, xs)[0])(state)
    inputs = [a for path, a in _staged(acc).items() if "input" in path]
    if pack_fp8:   # a packed group holds every input and kernel row: check the max is there
        inputs = [np.ravel(a) for a in _staged(acc).values()]
    want = np.float32(max(float(jnp.max(jnp.abs(X1))), float(jnp.max(jnp.abs(X2)))))
    assert any(want in np.ravel(a) for a in inputs)
    assert all(is_state(s) for s in jax.tree.leaves(jax_fp8.unpack_states(state.fp8),
                                                    is_leaf=is_state))
