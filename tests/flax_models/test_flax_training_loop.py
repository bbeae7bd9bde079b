"""Training loops with the Flax layers: every plausible loop updates the FP8 state or fails
with an error that says what to pass; gradient accumulation combines amaxes by max and
updates once per optimizer step; evaluation and scan without the FP8 collection name it;
one recipe rule for linen and NNX.

Loops that compare two programs bit for bit run on the CPU (its GEMMs accumulate in one
order in both programs)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization
from flax.training import train_state

import jax_fp8
from helpers import assert_trees_equal, rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState, nnx as fnnx

RECIPE = jax_fp8.DelayedScaling(history_len=4)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
D = 8


pytestmark = pytest.mark.usefixtures("on_cpu")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(D, dot_general_cls=DG)(x))
        return nn.Dense(4, dot_general_cls=DG)(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(D, dot_general_cls=DG)(x)), None


class Scanned(nn.Module):
    """Three layers under nn.scan, the FP8 collection one state per layer."""
    fp8_axes: bool = True

    @nn.compact
    def __call__(self, x):
        axes = {"params": 0, FP8_COLLECTION: 0} if self.fp8_axes else {"params": 0}
        stack = nn.scan(Block, variable_axes=axes, split_rngs={"params": True}, length=3)
        return stack(name="stack")(x, None)[0]


def make_state(model, x, tx=optax.sgd(0.1), **kw):  # noqa: B008 (immutable, never changed)
    v = jax.jit(model.init)(jax.random.key(0), x)
    return Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=tx, recipe=RECIPE,
                                **kw)


def mse(state, x, y):
    def loss_fn(params, fp8):
        return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2)
    return loss_fn


# -- linen: the loop that forgets the FP8 collection ------------------------------------

def test_linen_gradient_of_params_only_raises_at_trace_time():
    x, y = rand(0, (8, D)), rand(1, (8, 4))
    state = make_state(MLP(), x)

    @jax.jit
    def step(state):
        loss, grads = jax.value_and_grad(mse(state, x, y))(state.params, state.fp8)
        return state.apply_gradients(grads=grads), loss

    with pytest.raises(ValueError, match=r"argnums=\(0, 1\).*frozen_scales"):
        step(state)


def test_linen_apply_gradients_refuses_params_only_gradients():
    # Under nn.scan the GEMMs see the scan body's tracers, not the differentiation:
    # apply_gradients is the defence there.
    x, y = rand(0, (8, D)), rand(1, (8, D))
    state = make_state(Scanned(), x)
    grads = jax.jit(jax.grad(mse(state, x, y)))(state.params, state.fp8)
    with pytest.raises(ValueError, match=r"no FP8 gradients.*3 delayed-scaling states.*"
                                         r"state.value_and_grad"):
        state.apply_gradients(grads=grads)
    with jax_fp8.frozen_scales():   # frozen on purpose: the FP8 state is kept
        new = state.apply_gradients(grads=grads)
    assert_trees_equal(new.fp8, state.fp8)
    want = train_state.TrainState.create(apply_fn=None, params=state.params,
                                         tx=optax.sgd(0.1)).apply_gradients(grads=grads)
    assert_trees_equal(new.params, want.params)
    with pytest.raises(ValueError, match="never updated|none of its"):
        jax_fp8.check_fp8_updated(new.fp8)


def test_frozen_scales_allows_input_gradients_with_the_current_scales():
    x = rand(0, (8, D))
    model = MLP()
    v = model.init(jax.random.key(0), x)
    f = lambda x: jnp.sum(model.apply(v, x))  # noqa: E731
    with pytest.raises(ValueError, match="frozen_scales"):
        jax.grad(f)(x)
    with jax_fp8.frozen_scales():
        dx = jax.grad(f)(x)
    # The same gradient as through the FP8 collection differentiated too.
    want = jax.grad(lambda x, fp8: jnp.sum(model.apply(
        {"params": v["params"], FP8_COLLECTION: fp8}, x)), argnums=(0, 1))(
            x, v[FP8_COLLECTION])[0]
    np.testing.assert_array_equal(dx, want)


# -- linen and NNX: the one-call path --------------------------------------------------

def test_linen_one_call_path_is_the_two_argument_path():
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    state = make_state(MLP(), x, tx=optax.adam(1e-2))

    @jax.jit
    def one_call(state):
        loss, grads = state.value_and_grad(mse(state, x, y))()
        return state.apply_gradients(grads=grads), loss, grads

    @jax.jit
    def explicit(state):
        loss, (g, fg) = jax.value_and_grad(mse(state, x, y), argnums=(0, 1))(
            state.params, state.fp8)
        return state.apply_gradients(grads=g, fp8_grads=fg), loss

    a, loss_a, grads = one_call(state)
    b, loss_b = explicit(state)
    assert set(grads) == {"params", FP8_COLLECTION}
    assert loss_a == loss_b
    assert_trees_equal(a, b)
    # The update ran: the first step's input amax is the newest history entry.
    meta = jax_fp8.unpack_states(a.fp8)["Dense_0"]["Fp8DotGeneral_0"]
    assert float(meta["input"].amax_history[-1]) == float(jax_fp8.compute_amax(x))
    jax_fp8.check_fp8_updated(a.fp8)

    # has_aux: ((loss, aux), grads), as jax.value_and_grad.
    def with_aux(params, fp8):
        out = state.apply_model(params, fp8, x)
        return jnp.mean((out - y) ** 2), out
    (loss, out), grads = jax.jit(lambda s: s.value_and_grad(with_aux, has_aux=True)())(state)
    assert loss == loss_a and out.shape == (16, 4) and set(grads) == {"params",
                                                                       FP8_COLLECTION}


class NnxNet(nnx.Module):
    def __init__(self, rngs, recipe=RECIPE):
        self.l1 = fnnx.Fp8Linear(D, D, recipe=recipe, rngs=rngs)
        self.l2 = fnnx.Fp8Linear(D, 4, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def test_linen_and_nnx_return_the_same_shapes():
    x, y = rand(0, (8, D)), rand(1, (8, 4))
    state = make_state(MLP(), x)
    model = NnxNet(nnx.Rngs(0))

    def nnx_loss(m, x, y):
        out = m(x)
        return jnp.mean((out - y) ** 2), out

    def linen_loss(params, fp8, x, y):
        out = state.apply_model(params, fp8, x)
        return jnp.mean((out - y) ** 2), out

    (l1, out1), g1 = jax.jit(lambda s: jax_fp8.flax.fp8_value_and_grad(
        linen_loss, has_aux=True)(s.params, s.fp8, x, y))(state)
    (l2, out2), g2 = nnx.jit(lambda m: fnnx.fp8_value_and_grad(nnx_loss, has_aux=True)(
        m, x, y))(model)
    assert l1.shape == l2.shape == () and out1.shape == out2.shape == (8, 4)
    assert set(g1) == {"params", FP8_COLLECTION}
    assert isinstance(g2, nnx.State)
    kinds = {type(v) for v in jax.tree.leaves(
        g2, is_leaf=lambda v: isinstance(v, nnx.Variable))}
    assert nnx.Param in kinds and fnnx.Fp8Grad in kinds


def _nnx_step(recipe=RECIPE):
    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = fnnx.fp8_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        fnnx.apply_gradients(model, optimizer, grads, recipe)
        return loss
    return step


def test_nnx_one_call_path_updates_params_and_fp8_state():
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = NnxNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref = NnxNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def by_hand(model, optimizer):
        diff = nnx.DiffState(0, nnx.Any(nnx.Param, fnnx.Fp8State))
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2), argnums=diff)(model)
        fg, pg = nnx.split_state(grads, fnnx.Fp8State, ...)
        optimizer.update(model, pg)
        fnnx.update_fp8(model, fg, RECIPE)

    step = _nnx_step()
    for _ in range(2):
        step(model, opt, x, y)
        by_hand(ref, ref_opt)
    assert_trees_equal(nnx.state(model), nnx.state(ref))
    st = fnnx.fp8_state(model)["l1"]["dot_general"]["input"].get_value()
    assert float(st.amax_history[-1]) > 0
    fnnx.check_fp8_updated(model)


def test_nnx_fp8_optimizer_update_is_apply_gradients():
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model, ref = NnxNet(nnx.Rngs(0)), NnxNet(nnx.Rngs(0))
    opt = fnnx.Fp8Optimizer(model, optax.adam(1e-2), wrt=nnx.Param, recipe=RECIPE)
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):      # the usual NNX loop, unchanged
        loss, grads = fnnx.fp8_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    for _ in range(2):
        step(model, opt)
        _nnx_step()(ref, ref_opt, x, y)
    assert_trees_equal(nnx.state(model), nnx.state(ref))
    fnnx.check_fp8_updated(model)
    with jax_fp8.frozen_scales():
        grads = nnx.grad(lambda m: jnp.sum(m(x)))(model)
    with pytest.raises(ValueError, match="no FP8 gradients"):
        opt.update(model, grads)


def test_nnx_fp8_optimizer_under_multi_steps_updates_once_from_the_max():
    k = 3
    x, y = rand(0, (k, 8, D), 2.0), rand(1, (k, 8, 4))
    x = x.at[1, 5].multiply(16.0)
    model = NnxNet(nnx.Rngs(0))
    opt = fnnx.Fp8Optimizer(model, optax.MultiSteps(optax.sgd(0.1), k), wrt=nnx.Param,
                            recipe=RECIPE)
    assert isinstance(opt.fp8_pending, fnnx.Fp8Pending)
    start = jax.tree.map(jnp.copy, fnnx.fp8_state(model))

    @nnx.jit
    def micro(model, optimizer, xb, yb):
        _, grads = fnnx.fp8_value_and_grad(lambda m: jnp.mean((m(xb) - yb) ** 2))(model)
        optimizer.update(model, grads)
        return fnnx.fp8_state(grads)

    fp8_grads = []
    for i in range(k):
        fp8_grads.append(micro(model, opt, x[i], y[i]))
        if i + 1 < k:
            assert_trees_equal(fnnx.fp8_state(model), start)
    want = jax_fp8.new_fp8_state(start, jax_fp8.combine_fp8_grads(*fp8_grads), RECIPE)
    assert_trees_equal(nnx.as_pure(fnnx.fp8_state(model)), nnx.as_pure(want))
    st = fnnx.fp8_state(model)["l1"]["dot_general"]["input"].get_value()
    assert float(st.amax_history[-1]) == float(np.max(np.abs(np.asarray(x))))
    assert not any(np.any(np.asarray(p)) for p in opt.fp8_pending.get_value())


def test_nnx_gradient_of_params_only_raises_at_trace_time():
    x = rand(0, (8, D))
    model = NnxNet(nnx.Rngs(0))
    with pytest.raises(ValueError, match="fp8_value_and_grad"):
        nnx.jit(lambda m: nnx.value_and_grad(lambda m: jnp.sum(m(x)))(m))(model)


def test_nnx_apply_gradients_refuses_params_only_gradients():
    x = rand(0, (8, D))
    model = NnxNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with jax_fp8.frozen_scales():
        grads = nnx.grad(lambda m: jnp.sum(m(x)))(model)
    before = jax.tree.map(jnp.copy, fnnx.fp8_state(model))
    with pytest.raises(ValueError, match="no FP8 gradients.*6 delayed-scaling"):
        fnnx.apply_gradients(model, opt, grads, RECIPE)
    with jax_fp8.frozen_scales():
        fnnx.apply_gradients(model, opt, grads, RECIPE)
    assert_trees_equal(fnnx.fp8_state(model), before)


def test_nnx_model_never_updated_is_detected():
    # A loop that differentiates the FP8 state but hands everything to a plain
    # nnx.Optimizer: optax refuses the FP8 gradients (Fp8Grad, an nnx.Param) at trace time.
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = NnxNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def forgetful(model, optimizer):
        _, grads = fnnx.fp8_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    with pytest.raises(ValueError, match=r"optax was given jax_fp8.*Fp8Optimizer"):
        forgetful(model, opt)
    with pytest.raises(ValueError, match=r"NnxNet: none of its 6 delayed-scaling states.*"
                                         r"apply_gradients"):
        fnnx.check_fp8_updated(model)
    _nnx_step()(model, opt, x, y)
    fnnx.check_fp8_updated(model)


def test_nnx_apply_gradients_refuses_multi_steps():
    x = rand(0, (8, D))
    model = NnxNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), 2), wrt=nnx.Param)
    _, grads = fnnx.fp8_value_and_grad(lambda m: jnp.sum(m(x)))(model)
    with pytest.raises(ValueError, match="MultiSteps.*Fp8Optimizer.*combine_fp8_grads"):
        fnnx.apply_gradients(model, opt, grads, RECIPE)


# -- gradient accumulation ----------------------------------------------------------------

def test_multi_steps_updates_fp8_once_per_optimizer_step_from_the_max():
    k = 4
    x, y = rand(0, (k, 8, D), 2.0), rand(1, (k, 8, 4))
    x = x.at[2, 3].multiply(16.0)   # one microbatch holds the largest input
    state = make_state(MLP(), x[0], tx=optax.MultiSteps(optax.sgd(0.1), k))
    assert state.fp8_pending is not None
    plain = make_state(MLP(), x[0], tx=optax.sgd(0.1))

    @jax.jit
    def micro(state, xb, yb):
        loss, grads = state.value_and_grad(mse(state, xb, yb))()
        return state.apply_gradients(grads=grads), grads

    s, fp8_grads = state, []
    for i in range(k):
        s, grads = micro(s, x[i], y[i])
        fp8_grads.append(grads[FP8_COLLECTION])
        if i + 1 < k:   # no FP8 update before the optimizer applies
            assert_trees_equal(s.fp8, state.fp8)
        if i == 1:      # the pending amaxes survive a checkpoint mid-cycle
            s = serialization.from_bytes(state, serialization.to_bytes(s))
    # One update, from the max of the microbatches' amaxes ...
    want = jax_fp8.new_fp8_state(state.fp8, jax_fp8.combine_fp8_grads(*fp8_grads), RECIPE)
    assert_trees_equal(s.fp8, want)
    assert_trees_equal(s.fp8_pending, jax.tree.map(jnp.zeros_like, s.fp8_pending))
    # ... which is the float32 max computed directly.
    meta = jax_fp8.unpack_states(s.fp8)["Dense_0"]["Fp8DotGeneral_0"]
    assert float(meta["input"].amax_history[-1]) == float(np.max(np.abs(np.asarray(x))))
    assert float(meta["input"].amax_history[-1]) == float(
        max(jax_fp8.compute_amax(x[i]) for i in range(k)))
    # The parameters: MultiSteps' mean of the microbatch gradients, applied once.
    g_mean = jax.tree.map(lambda *g: sum(g) / k, *[
        jax.grad(mse(plain, x[i], y[i]), argnums=(0, 1))(plain.params, plain.fp8)[0]
        for i in range(k)])
    want_p = plain.apply_gradients(grads=g_mean, fp8_grads=jax_fp8.combine_fp8_grads(
        *fp8_grads)).params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 s.params, want_p)
    # The next cycle starts from nothing pending.
    s2, _ = micro(s, x[0], y[0])
    assert_trees_equal(s2.fp8, s.fp8)


def test_microbatch_scan_gives_the_max_of_the_microbatch_amaxes():
    k = 4
    x, y = rand(0, (k * 8, D), 2.0), rand(1, (k * 8, 4))
    x = x.at[21].multiply(16.0)
    state = make_state(MLP(), x)

    @jax.jit
    def step(state):
        def body(acc, batch):
            loss, grads = state.value_and_grad(mse(state, *batch))()
            g, fg = grads["params"], grads[FP8_COLLECTION]
            return (jax.tree.map(jnp.add, acc[0], g),
                    jax_fp8.combine_fp8_grads(acc[1], fg)), loss
        zeros = jax.tree.map(jnp.zeros_like, (state.params, state.fp8))
        (g, fg), _ = jax.lax.scan(body, zeros, (x.reshape(k, 8, D), y.reshape(k, 8, 4)))
        g = jax.tree.map(lambda a: a / k, g)
        return state.apply_gradients(grads={"params": g, FP8_COLLECTION: fg}), fg

    new, _ = step(state)
    meta = jax_fp8.unpack_states(new.fp8)["Dense_0"]["Fp8DotGeneral_0"]
    assert float(meta["input"].amax_history[-1]) == float(np.max(np.abs(np.asarray(x))))
    assert float(meta["kernel"].amax_history[-1]) == float(np.max(np.abs(np.asarray(
        state.params["Dense_0"]["kernel"]))))
    # The FP8 state was updated once: one history entry written.
    assert np.count_nonzero(np.asarray(meta["input"].amax_history)) == 1


# -- evaluation and scan ------------------------------------------------------------------

def test_apply_without_the_fp8_collection_names_it():
    x = rand(0, (4, D))
    model = MLP()
    v = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"/Dense_0/Fp8DotGeneral_0.*'fp8_meta'.*"
                                         r"state.apply_model"):
        model.apply({"params": v["params"]}, x)
    state = make_state(model, x)
    np.testing.assert_array_equal(state.apply_model(state.params, state.fp8, x),
                                  model.apply(v, x))


def test_nn_scan_without_the_fp8_collection_shows_the_line_to_add():
    x = rand(0, (4, D))
    with pytest.raises(ValueError, match=r"inside `scan`.*variable_axes=\{'params': 0, "
                                         r"'fp8_meta': 0\}"):
        Scanned(fp8_axes=False).init(jax.random.key(0), x)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = fnnx.Fp8Linear(D, D, recipe=RECIPE, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


def test_nnx_scan_over_stacked_layers():
    n = 3

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return NnxBlock(nnx.Rngs(key))

    stack = make(jax.random.split(jax.random.key(0), n))
    st = fnnx.fp8_state(stack)["lin"]["dot_general"]["input"].get_value()
    assert st.amax_history.shape == (n, RECIPE.history_len) and st.scale.shape == (n,)
    x = rand(1, (4, D), 3.0)

    def scanned(stack, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, x):
            return layer(x)
        return jnp.sum(body(stack, x))

    # The same layers unrolled, each its own module.
    graphdef, state = nnx.split(stack)
    layers = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(n)]

    def unrolled(layers, x):
        for layer in layers:
            x = layer(x)
        return jnp.sum(x)

    loss_s, g_s = nnx.jit(lambda s: fnnx.fp8_value_and_grad(scanned)(s, x))(stack)
    loss_u, g_u = nnx.jit(lambda ls: fnnx.fp8_value_and_grad(unrolled)(ls, x))(layers)
    assert loss_s == loss_u
    got = jax_fp8.amax_cotangents(fnnx.fp8_state(g_s))["lin"]["dot_general"]
    want = jax_fp8.amax_cotangents(fnnx.fp8_state(g_u))
    for name in ("input", "kernel", "grad"):
        np.testing.assert_array_equal(
            got[name][...], [want[i]["lin"]["dot_general"][name][...] for i in range(n)])
    fnnx.update_fp8(stack, g_s, RECIPE)       # one update of the [n, L] stacks
    hist = fnnx.fp8_state(stack)["lin"]["dot_general"]["kernel"].get_value().amax_history
    np.testing.assert_array_equal(hist[:, -1], got["kernel"][...])


# -- one API for the three recipes ----------------------------------------------------------

def test_new_fp8_state_takes_every_recipe():
    for recipe in (jax_fp8.Float8CurrentScaling(), jax_fp8.Float8BlockScaling()):
        assert jax_fp8.new_fp8_state({}, {}, recipe) == {}
        meta = jax_fp8.Fp8Meta.create(recipe)
        assert jax_fp8.new_fp8_state(meta, meta, recipe) is meta
        with pytest.raises(ValueError, match=f"{type(recipe).__name__} keeps none"):
            jax_fp8.new_fp8_state(jax_fp8.Fp8Meta.create(RECIPE), jax_fp8.Fp8Meta.create(
                RECIPE), recipe)
    # No recipe means DelayedScaling(), checked like any other.
    with pytest.raises(ValueError, match="history length 4, the recipe's is 1024"):
        jax_fp8.new_fp8_state(jax_fp8.Fp8Meta.create(RECIPE), jax_fp8.Fp8Meta.create(RECIPE))


def test_stateless_train_state_needs_no_fp8_gradients():
    x, y = rand(0, (8, 128)), rand(1, (8, 128))
    dg = functools.partial(Fp8DotGeneral, recipe=jax_fp8.Float8CurrentScaling())
    model = nn.Dense(128, dot_general_cls=dg)
    v = model.init(jax.random.key(0), x)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(0.1),
                                 recipe=jax_fp8.Float8CurrentScaling())
    g = jax.grad(lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(state.params)
    new = state.apply_gradients(grads=g)
    assert int(new.step) == 1


@pytest.mark.parametrize("recipe", [jax_fp8.Float8CurrentScaling(),
                                    jax_fp8.Float8BlockScaling(), None])
def test_nnx_update_fp8_recipe_mismatch_is_an_error(recipe):
    x = rand(0, (4, D))
    model = NnxNet(nnx.Rngs(0))   # history 4
    _, grads = fnnx.fp8_value_and_grad(lambda m: jnp.sum(m(x)))(model)
    before = jax.tree.map(jnp.copy, fnnx.fp8_state(model))
    match = "history length 4, the recipe's is 1024" if recipe is None else "keeps none"
    with pytest.raises(ValueError, match=match):
        fnnx.update_fp8(model, grads, recipe)
    assert_trees_equal(fnnx.fp8_state(model), before)
    # apply_gradients checks the recipe before the optimizer steps: nothing changes.
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match=match):
        fnnx.apply_gradients(model, opt, grads, recipe)
    assert_trees_equal(nnx.state(model, nnx.Param), params)


def test_dot_general_class_and_instance_errors_name_the_public_class():
    x = rand(0, (4, D))
    with pytest.raises(TypeError, match=r"Fp8DotGeneral was called as a function.*"
                                        r"an instance, Fp8DotGeneral\(recipe\)") as err:
        nnx.Linear(D, 4, dot_general=fnnx.Fp8DotGeneral, rngs=nnx.Rngs(0))(x)
    assert "_Fp8Base" not in str(err.value)
    with pytest.raises(TypeError, match=r"dot_general_cls=Fp8DotGeneral"):
        nn.Dense(4, dot_general_cls=Fp8DotGeneral()).init(jax.random.key(0), x)
    # An instance where an instance is taken, a class where a class is: the same numbers.
    v = nn.Dense(4, dot_general=Fp8DotGeneral()).init(jax.random.key(0), x)
    w = nn.Dense(4, dot_general_cls=Fp8DotGeneral).init(jax.random.key(0), x)
    np.testing.assert_array_equal(nn.Dense(4, dot_general=Fp8DotGeneral()).apply(v, x),
                                  nn.Dense(4, dot_general_cls=Fp8DotGeneral).apply(w, x))


def test_linen_optimizer_given_the_fp8_collection_is_detected():
    """The plain Flax loop over *all* variables: TrainState.create(params=variables). optax
    refuses the FP8 states at the optimizer's init, before any step; check_fp8_updated
    still names states that an optimizer wrote (negative amaxes) however they got there."""
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = MLP()
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"optax was given jax_fp8 FP8 scaling states.*"
                                         r"Fp8TrainState.create"):
        train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                      tx=optax.adamw(1e-2))
    written = jax.tree.map(
        lambda s: s.replace(amax_history=s.amax_history - 1.0)
        if isinstance(s, jax_fp8.ScalingState) else s,
        variables, is_leaf=lambda s: isinstance(s, jax_fp8.ScalingState))
    with pytest.raises(ValueError, match=r"negative amaxes.*Dense_0.*an optimizer given the "
                                         r"FP8 state.*Fp8TrainState"):
        jax_fp8.check_fp8_updated(written)
    # The same check passes on the loop that keeps the FP8 state out of the optimizer.
    good = Fp8TrainState.create(apply_fn=model.apply, params=variables["params"],
                                fp8=variables[FP8_COLLECTION], tx=optax.adamw(1e-2),
                                recipe=RECIPE)
    loss_fn = lambda p, f: jnp.mean((good.apply_model(p, f, x) - y) ** 2)  # noqa: E731
    for _ in range(3):
        _, grads = good.value_and_grad(loss_fn)()
        good = good.apply_gradients(grads=grads)
    jax_fp8.check_fp8_updated(good.fp8)


def test_nnx_optimizer_over_the_fp8_states_is_detected():
    """nnx.Optimizer(wrt=(nnx.Param, Fp8State)) would update the FP8 states with their
    gradients: optax refuses them, when the optimizer is made (adam's moments) or at the
    first update's trace (sgd keeps no state), before any FP8 state is written."""
    x, y = rand(0, (16, D)), rand(1, (16, 4))
    model = NnxNet(nnx.Rngs(0))
    match = r"optax was given jax_fp8 FP8 scaling states.*Fp8Optimizer"
    with pytest.raises(ValueError, match=match):
        nnx.Optimizer(model, optax.adam(0.1), wrt=(nnx.Param, fnnx.Fp8State))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=(nnx.Param, fnnx.Fp8State))

    @nnx.jit
    def step(model, optimizer):
        diff = nnx.DiffState(0, (nnx.Param, fnnx.Fp8State))
        _, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2), argnums=diff)(model)
        optimizer.update(model, grads)

    before = jax.tree.map(jnp.copy, nnx.state(model))
    with pytest.raises(ValueError, match=match):
        step(model, opt)
    assert_trees_equal(nnx.state(model), before)
