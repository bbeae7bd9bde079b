"""The Equinox training loop with FP8 layers: eqx.filter_jit / filter_value_and_grad / optax
over jax_fp8.equinox.params, ONE fused FP8 update per step, the loop a user writes first
refused naming the fix, microbatches, filter_checkpoint, scanned stacked layers,
inference."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import jax_fp8
import jax_fp8.equinox as jfe
from eqx_models import ScannedMLP, mse
from jax_fp8 import Fp8Rule

RECIPE = jax_fp8.DelayedScaling(history_len=4)
RULE = Fp8Rule(recipe=RECIPE, min_fp8_flops=0)
UPDATE = 'custom_call_target="jax_fp8_update"'
assert_equal = np.testing.assert_array_equal
needs_kernel = pytest.mark.skipif(not (jax_fp8.HAS_CPU_KERNEL or jax_fp8.HAS_CUDA_KERNEL),
                                  reason="jax_fp8 kernels not built")


def _mlp(key=0):
    mlp = eqx.nn.MLP(in_size=32, out_size=32, width_size=64, depth=2, key=jr.key(key))
    return jfe.fp8_model(mlp, RULE)


def _data(key=1, n=8):
    kx, ky = jr.split(jr.key(key))
    return jr.normal(kx, (n, 32)) * 2, jr.normal(ky, (n, 32))


def sum_loss(model, x, y):
    return jnp.sum((jax.vmap(model)(x) - y) ** 2)


optim = optax.adamw(1e-3)


@eqx.filter_jit
def train_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(sum_loss)(model, x, y)
    updates, opt_state = optim.update(jfe.params(grads), opt_state, jfe.params(model))
    return jfe.apply_updates(model, updates, grads), opt_state, loss


def test_the_plain_equinox_loop_is_refused_naming_the_fix():
    model = _mlp()
    x, y = _data()
    with pytest.raises(ValueError, match=r"optax was given .*jax_fp8\.equinox\.params"):
        optim.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = optim.init(jfe.params(model))

    @eqx.filter_jit
    def whole_grads(model, opt_state, x, y):
        grads = eqx.filter_grad(sum_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, jfe.params(model))
        return updates

    with pytest.raises(ValueError, match=r"optax was given .*jax_fp8\.equinox\.apply_updates"):
        whole_grads(model, opt_state, x, y)

    @eqx.filter_jit
    def eqx_apply(model, opt_state, x, y):
        grads = eqx.filter_grad(sum_loss)(model, x, y)
        updates, opt_state = optim.update(jfe.params(grads), opt_state, jfe.params(model))
        return eqx.apply_updates(model, updates)

    with pytest.raises(ValueError, match=r"eqx.apply_updates .*scales would never change"):
        eqx_apply(model, opt_state, x, y)
    updates = jax.tree.map(jnp.zeros_like, jfe.params(model))
    with pytest.raises(ValueError, match="optax was given"):
        optax.apply_updates(model, updates)
    with pytest.raises(ValueError, match="eqx.apply_updates"):
        eqx.apply_updates(model, updates)


@needs_kernel
def test_one_step_updates_the_fp8_states_in_one_fused_op():
    """After one step each state holds the update of what the step observed: max|x| of
    each layer's input, max|W|, max|dL/dy| (computed here independently); the parameters
    move by optax's update of their gradients; the compiled step has ONE FP8 update."""
    model = _mlp()
    x, y = _data()
    opt_state = optim.init(jfe.params(model))
    new, _, _ = train_step(model, opt_state, x, y)
    # What the step observed, from the model's own activations.
    layers = model.layers
    h1 = jax.vmap(layers[0])(x)
    a1 = jax.nn.relu(h1)
    h2 = jax.vmap(layers[1])(a1)
    a2 = jax.nn.relu(h2)
    out_grad = jax.grad(lambda o: jnp.sum((o - y) ** 2))(jax.vmap(layers[2])(a2))
    with jax_fp8.frozen_scales():   # the same FP8 GEMMs, differentiated w.r.t. activations
        dh2 = jax.grad(lambda h: sum_loss_from(h, layers, y, 1))(h2)
        dh1 = jax.grad(lambda h: sum_loss_from(h, layers, y, 0))(h1)
    inputs, grads_out = (x, a1, a2), (dh1, dh2, out_grad)
    for i, layer in enumerate(new.layers):
        meta = model.layers[i].fp8.meta
        amaxes = jax_fp8.Fp8Meta(input=jnp.max(jnp.abs(inputs[i])),
                                 kernel=jnp.max(jnp.abs(model.layers[i].weight)),
                                 grad=jnp.max(jnp.abs(grads_out[i])))
        want = jax_fp8.update_states(meta, amaxes, recipe=RECIPE)
        for got, ref in zip(jax.tree.leaves(layer.fp8.meta), jax.tree.leaves(want)):
            assert_equal(got, ref)
    hlo = train_step.lower(model, opt_state, x, y).compile().compiled.as_text()
    assert hlo.count(UPDATE) == 1
    assert not np.array_equal(new.layers[0].weight, model.layers[0].weight)


def sum_loss_from(h, layers, y, i):
    """The loss from layer i's pre-activation output (a float32 reference of the rest)."""
    for layer in layers[i + 1:]:
        h = jax.vmap(layer)(jax.nn.relu(h))
    return jnp.sum((h - y) ** 2)


def test_missing_fp8_gradients_are_refused_and_frozen_scales_keep_them():
    model = _mlp()
    x, y = _data()
    grads = eqx.filter_grad(sum_loss)(model, x, y)
    updates = jax.tree.map(jnp.zeros_like, jfe.params(model))
    with pytest.raises(ValueError, match="no gradient for the FP8 state"):
        jfe.apply_updates(model, updates, jfe.params(grads))
    with jax_fp8.frozen_scales():
        kept = jfe.apply_updates(model, updates, jfe.params(grads))
    for (_, a), (_, b) in zip(jfe.fp8_states(kept), jfe.fp8_states(model)):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert_equal(u, v)


def test_microbatches_combine_amaxes_by_max():
    """Two microbatches accumulated with accumulate_grads update the FP8 states exactly as
    the whole batch does (a sum loss: the same per-example gradients); summing the
    gradient trees would add the amaxes."""
    model = _mlp()
    x, y = _data(n=8)
    whole = eqx.filter_grad(sum_loss)(model, x, y)
    g1 = eqx.filter_grad(sum_loss)(model, x[:4], y[:4])
    g2 = eqx.filter_grad(sum_loss)(model, x[4:], y[4:])
    acc = jfe.accumulate_grads(g1, g2)
    for (_, a), (_, b) in zip(jfe.fp8_states(acc), jfe.fp8_states(whole)):
        assert_equal(a.meta.input.amax_history, b.meta.input.amax_history)
        assert_equal(a.meta.kernel.amax_history, b.meta.kernel.amax_history)
        assert_equal(a.meta.grad.amax_history, b.meta.grad.amax_history)
    summed = jax.tree.map(jnp.add, g1, g2)
    assert summed.layers[0].fp8.meta.kernel.amax_history[0] == \
        2 * whole.layers[0].fp8.meta.kernel.amax_history[0]
    np.testing.assert_allclose(acc.layers[0].weight, whole.layers[0].weight, rtol=1e-5,
                               atol=1e-5)
    updates = jax.tree.map(jnp.zeros_like, jfe.params(model))
    a, b = jfe.apply_updates(model, updates, acc), jfe.apply_updates(model, updates, whole)
    for u, v in zip(jax.tree.leaves(jfe.fp8_states(a)), jax.tree.leaves(jfe.fp8_states(b))):
        assert_equal(u, v)


def test_a_linear_map_of_the_whole_gradient_tree_keeps_the_amaxes():
    """The FP8 states' gradients are amax records: a loss scale undone over the whole tree
    (jax.tree.map(lambda g: g / scale, grads)), or the average of accumulated microbatches
    (the whole accumulated tree divided by their number), updates the FP8 states exactly
    as the unscaled gradients do."""
    model = _mlp()
    x, y = _data(n=8)
    updates = jax.tree.map(jnp.zeros_like, jfe.params(model))

    def fp8_after(grads):
        return jax.tree.leaves(jfe.fp8_states(jfe.apply_updates(model, updates, grads)))

    scale = 2.0 ** 15
    plain = eqx.filter_grad(sum_loss)(model, x, y)
    scaled = eqx.filter_grad(lambda m, x, y: sum_loss(m, x, y) * scale)(model, x, y)
    unscaled = jax.tree.map(lambda g: g / scale, scaled)
    for name in ("input", "kernel"):   # the forward's amaxes: the unscaled step's
        for (_, a), (_, b) in zip(jfe.fp8_states(unscaled), jfe.fp8_states(plain)):
            assert_equal(jax_fp8.amax_cotangents(getattr(a.meta, name)),
                         jax_fp8.amax_cotangents(getattr(b.meta, name)))
    for (_, a), (_, b) in zip(jfe.fp8_states(unscaled), jfe.fp8_states(scaled)):
        assert_equal(jax_fp8.amax_cotangents(a.meta.grad), jax_fp8.amax_cotangents(b.meta.grad))
    g1 = eqx.filter_grad(sum_loss)(model, x[:4], y[:4])
    g2 = eqx.filter_grad(sum_loss)(model, x[4:], y[4:])
    averaged = jax.tree.map(lambda g: g / 2, jfe.accumulate_grads(g1, g2))
    for u, v in zip(fp8_after(averaged), fp8_after(plain)):
        assert_equal(u, v)


class Block(eqx.Module):
    ff: eqx.nn.MLP

    def __call__(self, x):
        return eqx.filter_checkpoint(lambda ff, x: ff(x))(self.ff, x)


def test_filter_checkpoint_gives_the_same_bits():
    mlp = eqx.nn.MLP(32, 32, 64, 2, key=jr.key(2))
    plain, remat = jfe.fp8_model(mlp, RULE), jfe.fp8_model(Block(mlp), RULE)
    x, y = _data()
    g_plain = eqx.filter_grad(sum_loss)(plain, x, y)
    g_remat = eqx.filter_grad(sum_loss)(remat, x, y)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat.ff)):
        assert_equal(a, b)


def test_scan_over_stacked_layers_trains_each_layers_state():
    model = jfe.fp8_model(ScannedMLP(32, 3, key=jr.key(3)), RULE)
    x, y = _data()
    opt_state = optim.init(jfe.params(model))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(mse)(model, x, y)
        updates, opt_state = optim.update(jfe.params(grads), opt_state, jfe.params(model))
        return jfe.apply_updates(model, updates, grads), opt_state, grads

    new, _, grads = step(model, opt_state)
    staged = grads.layers.fp8.meta.input.amax_history[:, 0]
    want = jax_fp8.update_states(model.layers.fp8.meta, jax_fp8.Fp8Meta(
        input=staged, kernel=grads.layers.fp8.meta.kernel.amax_history[:, 0],
        grad=grads.layers.fp8.meta.grad.amax_history[:, 0]), recipe=RECIPE)
    for got, ref in zip(jax.tree.leaves(new.layers.fp8.meta), jax.tree.leaves(want)):
        assert_equal(got, ref)
    assert new.layers.fp8.meta.input.scale.shape == (3,)
    jfe.check_fp8_updated(new)


def test_inference_reads_the_state_and_input_gradients_need_frozen_scales():
    model = _mlp()
    x, y = _data()
    opt_state = optim.init(jfe.params(model))
    with pytest.raises(ValueError, match="none of its"):
        jfe.check_fp8_updated(model)
    for _ in range(2):
        model, opt_state, _ = train_step(model, opt_state, x, y)
    jfe.check_fp8_updated(model)
    infer = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    before = jfe.fp8_states(model)
    out = infer(model, x)
    np.testing.assert_array_equal(out, infer(model, x))
    assert [p for p, _ in jfe.fp8_states(model)] == [p for p, _ in before]
    saliency = jax.grad(lambda x: jnp.sum(jax.vmap(model)(x)))
    with pytest.raises(ValueError, match="frozen_scales"):
        saliency(x)
    with jax_fp8.frozen_scales():
        assert saliency(x).shape == x.shape


def test_multi_steps_is_refused_given_the_optimizer_state():
    """optax.MultiSteps applies once per k calls while apply_updates updates the FP8
    states at every call: given opt_state, the step refuses it, naming accumulate_grads;
    the same optimizer without MultiSteps trains."""
    model = _mlp()
    x, y = _data()
    for optimizer, refused in ((optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2), True),
                               (optax.chain(optax.clip_by_global_norm(1.0),
                                            optax.MultiSteps(optax.sgd(1e-3), 2)), True),
                               (optax.adamw(1e-3), False)):
        opt_state = optimizer.init(jfe.params(model))

        @eqx.filter_jit
        def step(model, opt_state, x, y, optimizer=optimizer):
            grads = eqx.filter_grad(sum_loss)(model, x, y)
            updates, opt_state = optimizer.update(jfe.params(grads), opt_state,
                                                  jfe.params(model))
            return jfe.apply_updates(model, updates, grads, opt_state=opt_state), opt_state

        if refused:
            with pytest.raises(ValueError, match=r"jax_fp8\.equinox\.apply_updates: the "
                               r"optimizer wraps optax\.MultiSteps.*jax_fp8\.equinox\."
                               r"accumulate_grads"):
                step(model, opt_state, x, y)
        else:
            new, _ = step(model, opt_state, x, y)
            assert not np.array_equal(new.layers[0].fp8.meta.input.amax_history,
                                      model.layers[0].fp8.meta.input.amax_history)
