"""The one-call FP8 train step under jax.pmap on 8 host devices, written as
vision_transformer's own loop is (a pmapped step over a replicated TrainState), linen and
NNX (run by test_pmap.py in a fresh process). Prints one JSON line of results."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils, nnx

import jax_fp8
from helpers import recorder
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, nnx as fnnx
from nnx_mlp import Fp8Mlp

assert jax.device_count() == 8
RECIPE = jax_fp8.DelayedScaling(history_len=4)
rng = np.random.default_rng(0)
X = jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
X = X * jnp.arange(1, 17, dtype=jnp.float32)[:, None]     # each device sees its own amax
Y = jnp.asarray(rng.standard_normal((16, 4)).astype(np.float32))
XS, YS = X.reshape(8, 2, 8), Y.reshape(8, 2, 4)
results: dict = {}
check = recorder(results)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dg = functools.partial(Fp8DotGeneral, recipe=RECIPE)
        return nn.Dense(4, dot_general_cls=dg)(nn.relu(nn.Dense(16, dot_general_cls=dg)(x)))


model = MLP()
state = Fp8TrainState.create(apply_fn=model.apply, variables=model.init(jax.random.key(0), X),
                             tx=optax.sgd(0.1), recipe=RECIPE)


def grads_of(state, x, y):
    def loss_fn(params, fp8):
        return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2)
    return state.value_and_grad(loss_fn)()[1]


def train_step(state, x, y, mode):
    grads = grads_of(state, x, y)
    if mode == "pmean_all":          # vision_transformer's own line, over every gradient
        grads = jax.lax.pmean(grads, axis_name="batch")
        return state.apply_gradients(grads=grads)
    grads = {**grads, "params": jax.lax.pmean(grads["params"], axis_name="batch")}
    if mode == "no_axis_name":
        return state.apply_gradients(grads=grads)
    return state.apply_gradients(grads=grads, axis_name="batch")


def run(mode):
    step = jax.pmap(functools.partial(train_step, mode=mode), axis_name="batch")
    return step(jax_utils.replicate(state), XS, YS)


def refusal(error, fn, *args) -> str:
    """The message of the `error` that fn(*args) raises; AssertionError("not refused") if it
    raises none."""
    try:
        fn(*args)
    except error as err:
        return str(err)
    raise AssertionError("not refused")


@check
def linen_pmean_over_all_gradients_is_refused():
    msg = refusal(TypeError, run, "pmean_all")
    assert "jax_fp8 FP8 gradient" in msg, msg


@check
def linen_without_axis_name_is_refused():
    msg = refusal(ValueError, run, "no_axis_name")
    assert "jax.pmap" in msg and "axis_name='batch'" in msg, msg


@check
def linen_axis_name_takes_the_max_over_devices():
    out = run("axis_name")
    replicas = [jax.tree.map(lambda a, i=i: np.asarray(a[i]), out.fp8) for i in range(8)]
    for r in replicas[1:]:
        jax.tree.map(np.testing.assert_array_equal, r, replicas[0])
    per_device = [grads_of(state, XS[i], YS[i])["fp8_meta"] for i in range(8)]
    want = jax_fp8.new_fp8_state(state.fp8, jax_fp8.combine_fp8_grads(*per_device), RECIPE)
    jax.tree.map(np.testing.assert_array_equal, replicas[0], jax.tree.map(np.asarray, want))


def nnx_run(axis_name):
    net = Fp8Mlp(nnx.Rngs(0), recipe=RECIPE)
    opt = fnnx.Fp8Optimizer(net, optax.sgd(0.1), wrt=nnx.Param, recipe=RECIPE)
    graphdef, st = nnx.split((net, opt))

    def step(st, x, y):
        net, opt = nnx.merge(graphdef, st)
        _, grads = fnnx.fp8_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(net)
        params, rest = nnx.split_state(grads, nnx.All(nnx.Param, nnx.Not(fnnx.Fp8Grad)), ...)
        grads = nnx.merge_state(jax.lax.pmean(params, "batch"), rest)
        opt.update(net, grads, axis_name=axis_name)
        return nnx.state((net, opt))

    return jax.pmap(step, axis_name="batch")(jax_utils.replicate(st), XS, YS), graphdef


@check
def nnx_without_axis_name_is_refused():
    msg = refusal(ValueError, nnx_run, None)
    assert "jax.pmap" in msg and "axis_name='batch'" in msg, msg


@check
def nnx_axis_name_keeps_the_replicas_equal_and_updates():
    out, graphdef = nnx_run("batch")
    fp8 = [jax.tree.map(lambda a, i=i: np.asarray(a[i]), fnnx.fp8_state(
        nnx.merge(graphdef, out)[0])) for i in range(8)]
    for r in fp8[1:]:
        jax.tree.map(np.testing.assert_array_equal, r, fp8[0])
    jax_fp8.check_fp8_updated(fp8[0])


print("RESULTS " + json.dumps(results))
