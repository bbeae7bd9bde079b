"""An Equinox data-parallel step under pmap on 8 host devices, written as Equinox's own BERT
example writes it: the replicated model, ``jax.lax.pmean`` over the WHOLE gradient tree,
then the optimizer (run by test_equinox_pmap.py in a fresh process). The FP8 gradients are
amax records that the backward max-reduces over the devices, so the mean (or sum) of the
tree leaves every record's amax the max over the devices: the new FP8 state is the one the
max of the devices' amaxes gives, bit for bit. Prints one JSON line of results."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import jax_fp8
import jax_fp8.equinox as jfe
from helpers import recorder

assert jax.device_count() == 8
RECIPE = jax_fp8.DelayedScaling(history_len=4)
results: dict = {}
check = recorder(results)

mlp = eqx.nn.MLP(in_size=32, out_size=32, width_size=64, depth=2, key=jr.key(0))
MODEL = jfe.fp8_model(mlp, jax_fp8.Fp8Rule(recipe=RECIPE, min_fp8_flops=0))
X = jr.normal(jr.key(1), (8, 4, 32)) * jnp.arange(1, 9, dtype=jnp.float32)[:, None, None]
Y = jr.normal(jr.key(2), (8, 4, 32))      # each device sees its own amaxes
optim = optax.sgd(1e-2)


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def replicate(tree):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (8,) + a.shape), tree)


def run(reduce, params_only=False):
    dynamic, static = eqx.partition(MODEL, eqx.is_array)
    opt_state = optim.init(jfe.params(MODEL))

    def step(dynamic, opt_state, x, y):
        model = eqx.combine(dynamic, static)
        _, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        param_grads = reduce(jfe.params(grads)) if params_only else jfe.params(grads)
        grads = grads if params_only else reduce(grads)
        updates, opt_state = optim.update(param_grads, opt_state, jfe.params(model))
        model = jfe.apply_updates(model, updates, grads, axis_name="devices")
        return eqx.filter(model, eqx.is_array), grads

    new, grads = jax.pmap(step, axis_name="devices")(replicate(dynamic), replicate(opt_state),
                                                       X, Y)
    return eqx.combine(new, static), grads


def states(model, i=None):
    """{path: (history, scale)} of the model's FP8 states (device i's replica)."""
    out = {}
    for path, st in jfe.fp8_states(model):
        for name in ("input", "kernel", "grad"):
            s = getattr(st.meta, name)
            h, sc = np.asarray(s.amax_history), np.asarray(s.scale)
            out[f"{path}.{name}"] = (h, sc) if i is None else (h[i], sc[i])
    return out


def want():
    """The rule: the max over the devices of the amaxes each device's step observes."""
    per_device = [eqx.filter_grad(loss_fn)(MODEL, X[i], Y[i]) for i in range(8)]
    total = per_device[0]
    for g in per_device[1:]:
        total = jfe.accumulate_grads(total, g)
    return states(jfe.apply_updates(MODEL, jax.tree.map(lambda _: None, jfe.params(MODEL)),
                                    total))


WANT = want()


def assert_rule(model):
    for i in range(8):
        got = states(model, i)
        assert got.keys() == WANT.keys()
        for path, (h, s) in WANT.items():
            np.testing.assert_array_equal(got[path][0], h, err_msg=f"{path} device {i}")
            np.testing.assert_array_equal(got[path][1], s, err_msg=f"{path} device {i}")


@check
def devices_see_different_amaxes():
    maxes = {p: float(h[-1]) for p, (h, _) in WANT.items()}
    firsts = states(jfe.apply_updates(MODEL, jax.tree.map(lambda _: None, jfe.params(MODEL)),
                                      eqx.filter_grad(loss_fn)(MODEL, X[0], Y[0])))
    assert any(float(firsts[p][0][-1]) < maxes[p] for p in maxes), (firsts, maxes)


@check
def pmean_of_the_whole_gradient_tree_records_the_max():   # Equinox's BERT example's line
    model, _ = run(lambda g: jax.lax.pmean(g, axis_name="devices"))
    assert_rule(model)


@check
def psum_of_the_whole_gradient_tree_records_the_max():
    model, _ = run(lambda g: jax.lax.psum(g, axis_name="devices"))
    assert_rule(model)


@check
def pmean_of_the_parameters_only_records_the_max():
    model, _ = run(lambda g: jax.lax.pmean(g, axis_name="devices"), params_only=True)
    assert_rule(model)


@check
def every_device_holds_the_same_records():
    _, grads = run(lambda g: g)
    for _, st in jfe.fp8_states(grads):
        for leaf in jax.tree.leaves(st.meta):
            leaf = np.asarray(leaf)
            for i in range(1, 8):
                np.testing.assert_array_equal(leaf[i], leaf[0])


print("RESULTS " + json.dumps(results))
