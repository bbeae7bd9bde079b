"""jax_fp8.flax.nnx: Fp8Linear / Fp8DotGeneral with Fp8State variables, one-call update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
from helpers import rand
from jax_fp8.flax import nnx as fnnx

RECIPE = jax_fp8.DelayedScaling(history_len=8)


class Net(nnx.Module):
    def __init__(self, rngs, reuse=1):
        self.l1 = fnnx.Fp8Linear(8, 16, recipe=RECIPE, rngs=rngs)
        self.l2 = nnx.Linear(16, 16, dot_general=fnnx.Fp8DotGeneral(RECIPE), rngs=rngs)
        self.l3 = fnnx.Fp8Linear(16, 4, recipe=RECIPE, rngs=rngs)
        self.reuse = reuse

    def __call__(self, x):
        x = nnx.relu(self.l1(x))
        for _ in range(self.reuse):
            x = jnp.tanh(self.l2(x))
        return self.l3(x)


def _get(v):
    return v.get_value() if hasattr(v, "get_value") else v.value


def test_layers_hold_fp8_state_variables():
    net = Net(nnx.Rngs(0))
    fp8 = fnnx.fp8_state(net)
    leaves = jax.tree.leaves(fp8, is_leaf=lambda x: isinstance(x, fnnx.Fp8State))
    assert len(leaves) == 9 and all(isinstance(v, fnnx.Fp8State) for v in leaves)
    assert isinstance(_get(net.l1.dot_general.input), jax_fp8.ScalingState)
    assert _get(net.l1.dot_general.grad).fp8_dtype == jnp.float8_e5m2
    assert _get(net.l1.dot_general.input).amax_history.shape == (8,)
    x = rand(0, (4, 8))
    out = nnx.jit(lambda m, x: m.l1(x))(net, x)
    meta = net.l1.dot_general.meta
    want, _ = jax_fp8.fp8_dot_general(x, net.l1.kernel[...], (((1,), (0,)), ((), ())), meta)
    np.testing.assert_allclose(out, want + net.l1.bias[...], rtol=1e-6, atol=1e-6)


def _split(grads):
    param_grads = nnx.split_state(grads, fnnx.Fp8Grad, ...)[1]
    return param_grads, fnnx.fp8_state(grads)


def _step_fn(recipe):
    def step(model, optimizer, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)
        loss, grads = fnnx.fp8_value_and_grad(loss_fn)(model)
        fnnx.apply_gradients(model, optimizer, grads, recipe)  # one fused update_states
        return (loss, *_split(grads))
    return step


def test_train_step_optimizer_never_sees_fp8_state():
    x, y = rand(0, (32, 8)), rand(1, (32, 4))
    net = Net(nnx.Rngs(0))
    tx = optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(1e-2, weight_decay=0.5))
    opt = nnx.Optimizer(net, tx, wrt=nnx.Param)
    opt_leaves = jax.tree.leaves(nnx.state(opt), is_leaf=lambda v: isinstance(v, fnnx.Fp8State))
    assert not any(isinstance(v, fnnx.Fp8State) for v in opt_leaves)
    fp8_before = jax.tree.map(jnp.copy, fnnx.fp8_state(net))
    step = nnx.jit(_step_fn(RECIPE))
    losses = []
    for i in range(25):
        loss, grads, fp8_grads = step(net, opt, x, y)
        losses.append(float(loss))
        if i == 0:
            assert all(not isinstance(v, fnnx.Fp8State) for v in jax.tree.leaves(
                grads, is_leaf=lambda v: isinstance(v, nnx.Variable)))
            want = jax.jit(jax_fp8.new_fp8_state, static_argnums=2)(fp8_before, fp8_grads, RECIPE)
            jax.tree.map(np.testing.assert_array_equal, fnnx.fp8_state(net), want)
            st = _get(net.l1.dot_general.input)
            assert float(st.amax_history[-1]) == float(jax_fp8.compute_amax(x))
            assert float(st.scale) == pytest.approx(448 / float(jax_fp8.compute_amax(x)))
    assert losses[-1] < 0.7 * losses[0]


class Unrolled(nnx.Module):
    """Net(reuse=3) with three distinct copies of l2 (same weights, own FP8 states)."""

    def __init__(self, src):
        self.l1, self.l3 = src.l1, src.l3
        self.a, self.b, self.c = (nnx.Linear(16, 16, dot_general=fnnx.Fp8DotGeneral(RECIPE),
                                             rngs=nnx.Rngs(1)) for _ in range(3))
        for l2 in (self.a, self.b, self.c):
            l2.kernel[...] = src.l2.kernel[...]
            l2.bias[...] = src.l2.bias[...]

    def __call__(self, x):
        x = nnx.relu(self.l1(x))
        for l2 in (self.a, self.b, self.c):
            x = jnp.tanh(l2(x))
        return self.l3(x)


def test_reused_layer_combines_by_max():
    x = rand(0, (4, 8), 3.0)

    @nnx.jit
    def fp8_grads(model):
        return _split(fnnx.fp8_value_and_grad(lambda m: jnp.sum(m(x)))(model)[1])[1]

    got = jax_fp8.amax_cotangents(fp8_grads(Net(nnx.Rngs(0), reuse=3)))
    per_use = jax_fp8.amax_cotangents(fp8_grads(Unrolled(Net(nnx.Rngs(0), reuse=3))))
    for name in ("input", "kernel", "grad"):
        uses = [float(per_use[k]["dot_general"][name][...]) for k in "abc"]
        g = float(got["l2"]["dot_general"][name][...])
        assert g == max(uses)
        if name != "kernel":
            assert g < sum(uses)


def test_one_update_custom_call_in_the_compiled_nnx_step():
    if not jax_fp8.HAS_CPU_KERNEL:
        pytest.skip("CPU kernel not built")
    x, y = rand(0, (8, 8)), rand(1, (8, 4))
    net = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(net, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((net, opt))

    def pure(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = _step_fn(RECIPE)(model, optimizer, x, y)[0]
        return nnx.state((model, optimizer)), loss

    hlo = jax.jit(pure).lower(state, x, y).compile().as_text()
    assert hlo.count('custom_call_target="jax_fp8_update"') == 1
