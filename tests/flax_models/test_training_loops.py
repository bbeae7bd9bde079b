"""The loops a Flax user writes first, linen and NNX, with every recipe where it applies:
each updates the FP8 state right or stops at trace time (or before the first step) with
an error naming the fix. FP8 states never go through optax; frozen_scales keeps the FP8
state in every loop; a model's FP8 state is never written by inference (a greedy decoder
under the usual sampler loops)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import helpers
import jax_fp8
from helpers import assert_trees_equal, rand, recipe_variant_cases
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState, nnx as fnnx
from jax_fp8.state import is_state
from nnx_mlp import Fp8Mlp

DELAYED = jax_fp8.DelayedScaling(history_len=4)
RECIPES = helpers.RECIPES
D = 8
REFUSED = r"optax was given jax_fp8 FP8 scaling states"


pytestmark = pytest.mark.usefixtures("on_cpu")


def states_of(tree):
    return [s for s in jax.tree.leaves(tree, is_leaf=is_state) if is_state(s)]


# ------------------------------------------------------------------------------ linen

class MLP(nn.Module):
    recipe: object = DELAYED

    @nn.compact
    def __call__(self, x):
        dg = functools.partial(Fp8DotGeneral, recipe=self.recipe)
        return nn.Dense(4, dot_general_cls=dg)(nn.relu(nn.Dense(16, dot_general_cls=dg)(x)))


def _linen(recipe, tx):
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = MLP(recipe)
    variables = model.init(jax.random.key(0), x)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=tx,
                                 recipe=recipe)
    return model, variables, state, x, y


def _linen_step(state, x, y):
    def loss_fn(params, fp8):
        return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2)
    loss, grads = state.value_and_grad(loss_fn)()
    return state.apply_gradients(grads=grads), loss


TXS = {
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "masked": lambda: optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(
        lambda a: a.ndim == 2, p)),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
}


# Every recipe trains through Fp8TrainState in tests/recipes/test_recipes.py
# (test_the_same_model_trains_with_each_recipe); here delayed scaling with every wrapper,
# and current scaling for the one-call path without FP8 state (the recipes without state
# differ only in their quantization there). NNX's Fp8Optimizer below: the same cases.
WRAPPER_CASES = [("current", "chain")] + [("delayed", tx) for tx in sorted(TXS)]


@pytest.mark.parametrize("recipe, tx", WRAPPER_CASES)
def test_linen_fp8_train_state_with_optax_wrappers_updates_params_and_fp8(recipe, tx):
    _, _, state, x, y = _linen(RECIPES[recipe], TXS[tx]())
    start = state
    step = jax.jit(_linen_step)
    for _ in range(4):
        state, _ = step(state, x, y)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)),
                                           start.params, state.params))
    assert any(changed)
    if recipe == "delayed":
        jax_fp8.check_fp8_updated(state.fp8)
        assert len(states_of(state.fp8.unpack())) == 6
    else:
        assert not states_of(state.fp8)


def test_linen_flax_train_state_over_all_variables_is_refused_at_create():
    model, variables, _, _, _ = _linen(DELAYED, optax.adam(1e-2))
    with pytest.raises(ValueError, match=REFUSED + r".*Fp8TrainState.create"):
        train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                      tx=optax.adam(1e-2))
    with pytest.raises(ValueError, match=REFUSED):   # optax.sgd keeps no state: at update
        state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                              tx=optax.sgd(1e-2))
        grads = jax.tree.map(jnp.zeros_like, variables)
        jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    masked = optax.masked(optax.adam(1e-2), {"params": True, FP8_COLLECTION: False})
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=masked)
    with pytest.raises(ValueError, match=REFUSED):   # masked out: its raw gradients applied
        jax.jit(lambda s, g: s.apply_gradients(grads=g))(
            state, jax.tree.map(jnp.zeros_like, variables))


@pytest.mark.parametrize("recipe", ["current"])   # the recipes without state: as WRAPPER_CASES
def test_linen_flax_train_state_over_all_variables_without_fp8_state_trains(recipe):
    """The recipes without state (current, block, MXFP8) keep none: Flax's own TrainState is
    right as is."""
    model, variables, _, x, y = _linen(RECIPES[recipe], optax.adam(1e-2))
    assert FP8_COLLECTION not in variables
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.adam(1e-2))
    grads = jax.grad(lambda v: jnp.mean((model.apply(v, x) - y) ** 2))(state.params)
    assert jax.tree.leaves(state.apply_gradients(grads=grads).params)


def test_linen_fp8_gradients_given_to_a_plain_train_state_are_refused():
    model, variables, _, x, y = _linen(DELAYED, optax.adam(1e-2))
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                          tx=optax.adam(1e-2))
    loss = lambda p, f: jnp.mean((model.apply({"params": p, FP8_COLLECTION: f}, x) - y) ** 2)  # noqa: E731
    _, grads = jax_fp8.flax.fp8_value_and_grad(loss)(state.params, variables[FP8_COLLECTION])
    with pytest.raises(ValueError, match=REFUSED):
        state.apply_gradients(grads=grads)
    with pytest.raises(ValueError, match=REFUSED):  # a global norm over them, too
        optax.global_norm(grads)
    assert float(optax.global_norm(grads["params"])) > 0


def test_linen_skip_step_on_nan_keeps_params_and_fp8_state():
    _, _, state, x, y = _linen(DELAYED, optax.adam(1e-2))

    @jax.jit
    def step(state, x):
        def loss_fn(params, fp8):
            return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2)
        loss, grads = state.value_and_grad(loss_fn)()
        return jax.lax.cond(jnp.isfinite(loss), lambda: state.apply_gradients(grads=grads),
                            lambda: state), loss

    skipped, loss = step(state, x.at[0, 0].set(jnp.nan))
    assert not np.isfinite(float(loss))
    assert_trees_equal(skipped, state)
    taken, _ = step(state, x)
    want, _ = jax.jit(_linen_step)(state, x, y)
    assert_trees_equal(taken, want)


def test_linen_input_gradients_need_frozen_scales_and_keep_the_state():
    _, _, state, x, _ = _linen(DELAYED, optax.adam(1e-2))
    saliency = jax.jit(jax.grad(lambda x, s: jnp.sum(s.apply_model(s.params, s.fp8, x))))
    with pytest.raises(ValueError, match=r"frozen_scales"):
        saliency(x, state)
    with jax_fp8.frozen_scales():
        dx = jax.jit(jax.grad(lambda x, s: jnp.sum(s.apply_model(s.params, s.fp8, x))))(
            x, state)
    assert dx.shape == x.shape and bool(jnp.all(jnp.isfinite(dx)))


def test_linen_gradient_penalty_is_a_trace_time_error():
    """A penalty on the input gradient differentiates the FP8 GEMM twice."""
    _, _, state, x, y = _linen(DELAYED, optax.adam(1e-2))

    def loss_fn(params, fp8):
        out = lambda x: state.apply_model(params, fp8, x)  # noqa: E731
        penalty = jnp.sum(jax.grad(lambda x: jnp.sum(out(x)))(x) ** 2)
        return jnp.mean((out(x) - y) ** 2) + penalty

    with pytest.raises((NotImplementedError, ValueError), match=r"fp8|FP8"):
        with jax_fp8.frozen_scales():
            jax.jit(lambda s: s.value_and_grad(loss_fn)())(state)


def test_linen_evaluation_inside_the_train_step():
    _, _, state, x, y = _linen(DELAYED, optax.adam(1e-2))

    @jax.jit
    def step(state):
        new, loss = _linen_step(state, x, y)
        return new, loss, jnp.mean((new.apply_model(new.params, new.fp8, x) - y) ** 2)

    new, _, eval_loss = step(state)
    want = jnp.mean((new.apply_model(new.params, new.fp8, x) - y) ** 2)
    np.testing.assert_array_equal(eval_loss, want)
    jax_fp8.check_fp8_updated(new.fp8)


@pytest.mark.parametrize("tx", ["adam", "multi_steps"])
def test_linen_frozen_scales_freezes_the_one_call_path(tx):
    opt = optax.adam(1e-2) if tx == "adam" else optax.MultiSteps(optax.adam(1e-2), 1)
    _, _, state, x, y = _linen(DELAYED, opt)
    with jax_fp8.frozen_scales():
        new, _ = jax.jit(_linen_step)(state, x, y)
    assert_trees_equal(new.fp8, state.fp8)
    assert_trees_equal(new.fp8_pending, state.fp8_pending)
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)),
                                            state.params, new.params)))
    after, _ = jax.jit(lambda *a: _linen_step(*a))(state, x, y)   # traced outside
    jax_fp8.check_fp8_updated(after.fp8)


# -------------------------------------------------------------------------------- NNX

def _net(recipe):
    return Fp8Mlp(nnx.Rngs(0), recipe=recipe, sizes=(D, 16, 4))


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("recipe", ["current", "delayed"])   # as WRAPPER_CASES
def test_nnx_plain_optimizer_with_fp8_gradients(recipe):
    """Delayed: the FP8 gradients (Fp8Grad, an nnx.Param) reach optax, which refuses them
    at trace time. A recipe without state: there are none, and the plain loop is right."""
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = _net(RECIPES[recipe])
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = fnnx.fp8_value_and_grad(_loss)(model, x, y)
        opt.update(model, grads)
        return loss

    if recipe == "delayed":
        before = jax.tree.map(jnp.copy, nnx.state(model))
        with pytest.raises(ValueError, match=REFUSED + r".*Fp8Optimizer"):
            step(model, opt)
        assert_trees_equal(nnx.state(model), before)
    else:
        losses = [float(step(model, opt)) for _ in range(5)]
        assert losses[-1] < losses[0]


def test_nnx_optimizers_that_would_take_the_fp8_state_are_refused():
    model = _net(DELAYED)
    with pytest.raises(ValueError, match=REFUSED):
        nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Any(nnx.Param, fnnx.Fp8State))
    with pytest.raises(ValueError, match=REFUSED):
        fnnx.Fp8Optimizer(model, optax.adam(1e-2), wrt=nnx.Any(nnx.Param, fnnx.Fp8State))
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    opt = nnx.ModelAndOptimizer(model, optax.adam(1e-2))     # the default wrt (nnx.Param)
    _, grads = fnnx.fp8_value_and_grad(_loss)(model, x, y)
    with pytest.raises(ValueError, match=REFUSED):
        opt.update(grads)


@pytest.mark.parametrize("recipe, tx", WRAPPER_CASES)     # as linen's test above
def test_nnx_fp8_optimizer_with_optax_wrappers_updates_params_and_fp8(recipe, tx):
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = _net(RECIPES[recipe])
    opt = fnnx.Fp8Optimizer(model, TXS[tx](), wrt=nnx.Param, recipe=RECIPES[recipe])
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))

    @nnx.jit
    def step(model, opt):
        loss, grads = fnnx.fp8_value_and_grad(_loss)(model, x, y)
        opt.update(model, grads)
        return loss

    for _ in range(4):
        step(model, opt)
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)),
                                            params, nnx.state(model, nnx.Param))))
    if recipe == "delayed":
        fnnx.check_fp8_updated(model)
    else:
        assert not states_of(fnnx.fp8_state(model))


def test_nnx_skip_step_on_nan_keeps_params_and_fp8_state():
    y = rand(1, (16, 4))
    model = _net(DELAYED)
    opt = fnnx.Fp8Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, recipe=DELAYED)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = fnnx.fp8_value_and_grad(_loss)(model, x, y)
        nnx.cond(jnp.isfinite(loss), lambda m, o, g: o.update(m, g),
                 lambda m, o, g: None, model, opt, grads)
        return loss

    before = jax.tree.map(jnp.copy, nnx.state((model, opt)))
    loss = step(model, opt, rand(0, (16, D)).at[0, 0].set(jnp.nan))
    assert not np.isfinite(float(loss))
    assert_trees_equal(nnx.state((model, opt)), before)
    step(model, opt, rand(0, (16, D)))
    fnnx.check_fp8_updated(model)


def test_nnx_input_gradients_need_frozen_scales_and_keep_the_state():
    x = rand(0, (16, D))
    model = _net(DELAYED)
    saliency = lambda m, x: jax.grad(lambda x: jnp.sum(m(x)))(x)  # noqa: E731
    with pytest.raises(ValueError, match=r"frozen_scales"):
        nnx.jit(saliency)(model, x)
    before = jax.tree.map(jnp.copy, fnnx.fp8_state(model))
    with jax_fp8.frozen_scales():
        dx = nnx.jit(saliency)(model, x)
    assert dx.shape == x.shape and bool(jnp.all(jnp.isfinite(dx)))
    assert_trees_equal(fnnx.fp8_state(model), before)


def test_nnx_evaluation_inside_the_train_step():
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = _net(DELAYED)
    opt = fnnx.Fp8Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, recipe=DELAYED)

    @nnx.jit
    def step(model, opt):
        loss, grads = fnnx.fp8_value_and_grad(_loss)(model, x, y)
        opt.update(model, grads)
        return _loss(model, x, y)

    eval_loss = step(model, opt)
    np.testing.assert_array_equal(eval_loss, nnx.jit(_loss)(model, x, y))
    fnnx.check_fp8_updated(model)


@pytest.mark.parametrize("how", ["Fp8Optimizer", "apply_gradients", "multi_steps"])
def test_nnx_frozen_scales_freezes_the_one_call_path(how):
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = _net(DELAYED)
    if how == "apply_gradients":
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    else:
        tx = optax.adam(1e-2) if how == "Fp8Optimizer" else optax.MultiSteps(
            optax.adam(1e-2), 1)
        opt = fnnx.Fp8Optimizer(model, tx, wrt=nnx.Param, recipe=DELAYED)

    def step(model, opt):
        loss, grads = fnnx.fp8_value_and_grad(_loss)(model, x, y)
        if how == "apply_gradients":
            fnnx.apply_gradients(model, opt, grads, DELAYED)
        else:
            opt.update(model, grads)

    fp8 = jax.tree.map(jnp.copy, fnnx.fp8_state(model))
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    with jax_fp8.frozen_scales():
        nnx.jit(step)(model, opt)
    assert_trees_equal(fnnx.fp8_state(model), fp8)
    assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)),
                                            params, nnx.state(model, nnx.Param))))
    nnx.jit(lambda *a: step(*a))(model, opt)   # a new trace outside the context
    fnnx.check_fp8_updated(model)


# ------------------------------------------------------- a greedy decoder, NNX samplers

V, STEPS = 16, 4


class Decoder(nnx.Module):
    """Token -> next-token logits through two FP8 layers."""

    def __init__(self, recipe, rngs):
        self.up = fnnx.Fp8Linear(V, 32, recipe=recipe, rngs=rngs)
        self.down = fnnx.Fp8Linear(32, V, recipe=recipe, rngs=rngs)

    def __call__(self, tok):
        return self.down(nnx.gelu(self.up(jax.nn.one_hot(tok, V))))


def _next(model, tok):
    return jnp.argmax(model(tok), -1).astype(jnp.int32)


def _python_loop(model, tok):
    step, out = nnx.jit(_next), []
    for _ in range(STEPS):
        tok = step(model, tok)
        out.append(tok)
    return jnp.stack(out)


def _split_merge_while_loop(model, tok):
    """The Gemma sampler's structure: split once, merge inside jit, a lax.while_loop whose
    body closes over the merged model."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def sample(state, tok):
        m = nnx.merge(graphdef, state)

        def body(carry):
            i, tok, out = carry
            tok = _next(m, tok)
            return i + 1, tok, out.at[i].set(tok)

        out = jnp.zeros((STEPS,) + tok.shape, jnp.int32)
        return jax.lax.while_loop(lambda c: c[0] < STEPS, body, (0, tok, out))[2]

    return sample(state, tok)


def _nnx_while_loop(model, tok):
    @nnx.jit
    def sample(model, tok):
        def body(carry):
            m, i, tok, out = carry
            tok = _next(m, tok)
            return m, i + 1, tok, out.at[i].set(tok)
        out = jnp.zeros((STEPS,) + tok.shape, jnp.int32)
        return nnx.while_loop(lambda c: c[1] < STEPS, body, (model, 0, tok, out))[3]
    return sample(model, tok)


def _fori_loop_closing_over(model, tok):
    @nnx.jit
    def sample(model, tok):
        def body(i, carry):
            tok, out = carry
            tok = _next(model, tok)
            return tok, out.at[i].set(tok)
        out = jnp.zeros((STEPS,) + tok.shape, jnp.int32)
        return jax.lax.fori_loop(0, STEPS, body, (tok, out))[1]
    return sample(model, tok)


def _nnx_scan(model, tok):
    @nnx.jit
    def sample(model, tok):
        @nnx.scan(in_axes=(None, nnx.Carry), out_axes=(nnx.Carry, 0), length=STEPS)
        def body(m, tok):
            tok = _next(m, tok)
            return tok, tok
        return body(model, tok)[1]
    return sample(model, tok)


SAMPLERS = {"python_loop": _python_loop, "split_merge_while_loop": _split_merge_while_loop,
            "nnx_while_loop": _nnx_while_loop, "fori_loop": _fori_loop_closing_over,
            "nnx_scan": _nnx_scan}


@pytest.mark.parametrize("recipe, sampler", recipe_variant_cases(SAMPLERS, "nnx_scan"))
def test_nnx_decoder_samples_under_every_loop_without_writing_fp8_state(recipe, sampler):
    model = Decoder(RECIPES[recipe], nnx.Rngs(0))
    if recipe == "delayed":   # trained scales, not the fresh ones
        opt = fnnx.Fp8Optimizer(model, optax.sgd(0.1), wrt=nnx.Param, recipe=DELAYED)
        toks = jnp.arange(8, dtype=jnp.int32)
        loss = lambda m: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            m(toks), (toks + 1) % V))
        for _ in range(3):
            _, grads = fnnx.fp8_value_and_grad(loss)(model)
            opt.update(model, grads)
    before = jax.tree.map(jnp.copy, nnx.state(model))
    tok = jnp.array([1, 5], jnp.int32)
    want, expect = [], tok
    for _ in range(STEPS):   # eager, one token at a time
        expect = _next(model, expect)
        want.append(expect)
    got = SAMPLERS[sampler](model, tok)
    np.testing.assert_array_equal(got, jnp.stack(want))
    assert_trees_equal(nnx.state(model), before)


# ------------------------------------------------------- one accumulation, linen and NNX

TWO_ACCUMULATIONS = r"holds 2 optax.MultiSteps; the FP8 state can follow one accumulation"


def test_linen_and_nnx_refuse_two_multi_steps_alike():
    """An optimizer with two MultiSteps: the FP8 state cannot follow both; linen's train
    state and NNX's optimizer say so when they are built (one rule, flax/multi_steps.py)."""
    tx = optax.chain(optax.MultiSteps(optax.adam(1e-2), 2), optax.MultiSteps(optax.sgd(1e-2), 3))
    with pytest.raises(ValueError, match=TWO_ACCUMULATIONS):
        _linen(DELAYED, tx)
    with pytest.raises(ValueError, match=TWO_ACCUMULATIONS):
        fnnx.Fp8Optimizer(_net(DELAYED), tx, wrt=nnx.Param, recipe=DELAYED)
