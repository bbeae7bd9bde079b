"""Generic pytree code a JAX user writes over gradients and variables, given FP8 state and
FP8 gradients, linen and NNX: the right numbers or an error at trace time, never a
silent change of what the FP8 update reads.

FP8 gradients from jax_fp8's value_and_grad functions are `jax_fp8.AmaxGrad`s, whose
array has an extended dtype that refuses arithmetic; the GEMMs dequantize with ``1 /
scale`` derived at use, so an average of FP8 states (an EMA) stays consistent."""

import functools
import importlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils, nnx
from flax.training import dynamic_scale as dynamic_scale_lib

import jax_fp8
from helpers import assert_trees_equal, rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState, nnx as fnnx
from jax_fp8.state import is_state
from nnx_mlp import Fp8Mlp

RECIPE = jax_fp8.DelayedScaling(history_len=4)
REFUSES_ARITHMETIC = r"jax_fp8 FP8 gradient: observed amaxes, no arithmetic"
S = 2.0 ** 8   # a loss scale (a power of two, as DynamicScale's)

pytestmark = pytest.mark.usefixtures("on_cpu")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dg = functools.partial(Fp8DotGeneral, recipe=RECIPE)
        return nn.Dense(4, dot_general_cls=dg)(nn.relu(nn.Dense(16, dot_general_cls=dg)(x)))


def _linen(pack_fp8=True):
    x, y = rand(0, (16, 8)), rand(1, (16, 4))
    model = MLP()
    state = Fp8TrainState.create(apply_fn=model.apply, variables=model.init(jax.random.key(0), x),
                                 tx=optax.sgd(1e-2), recipe=RECIPE, pack_fp8=pack_fp8)
    return model, state, x, y


def _loss(state, x, y, scale=1.0):
    def loss_fn(params, fp8):
        return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2) * scale
    return loss_fn


def _newest(fp8):
    """{path: the newest history entry} of every state (unpacked)."""
    tree = jax_fp8.unpack_states(fp8)
    return {jax.tree_util.keystr(p): np.asarray(s.amax_history[..., -1])
            for p, s in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)[0]
            if is_state(s)}


def _role(path):
    return path.split("'")[-2]


# ------------------------------------------------------------------------------- linen

def test_linen_fp8_gradients_refuse_every_arithmetic_at_trace_time():
    _, state, x, y = _linen()
    _, grads = state.value_and_grad(_loss(state, x, y))()
    fp8_grads = grads[FP8_COLLECTION]
    assert all(isinstance(g, jax_fp8.AmaxGrad) for g in fp8_grads.groups)
    leaves = jax.tree.leaves(grads)
    idioms = {
        "a loss scale undone (DynamicScale)": lambda: jax.tree.map(lambda g: g / S, grads),
        "cast to float32 first": lambda: jax.tree.map(
            lambda g: jnp.asarray(g, jnp.float32) / S, grads),
        "clip by global norm, by hand": lambda: jnp.sqrt(sum(jnp.sum(g ** 2) for g in leaves)),
        "clip factor applied": lambda: jax.tree.map(lambda g: g * 0.5, grads),
        "microbatch sum": lambda: jax.tree.map(jnp.add, grads, grads),
        "mean over devices": lambda: jax.vmap(lambda g: jax.lax.pmean(g, "d"),
                                              axis_name="d")(
            jax.tree.map(lambda a: a[None], grads)),
        "maximum by hand": lambda: jax.tree.map(jnp.maximum, grads, grads),
    }
    for name, idiom in idioms.items():
        with pytest.raises((TypeError, ValueError), match=REFUSES_ARITHMETIC):
            jax.jit(idiom)()
        del name
    with pytest.raises(ValueError, match=r"optax was given jax_fp8.*Fp8TrainState"):
        optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    rebuilt = jax.tree.map(lambda g: jnp.zeros(g.shape), grads)
    with pytest.raises(TypeError, match=r"fp8_grads.*holds a float32 array where the "
                                        r"update reads the observed amaxes.*grads\['params'\]"):
        state.apply_gradients(grads=rebuilt)


def test_linen_loss_scaling_on_the_parameter_gradients_gives_the_rule_s_scales():
    """DynamicScale's arithmetic applied where it belongs (grads["params"]): the input and
    kernel states record the amaxes of the unscaled step, the gradient states the amaxes
    of the gradient the backward GEMM quantized (the scaled one, S times larger)."""
    _, state, x, y = _linen()

    @jax.jit
    def step(state, scale):
        _, grads = state.value_and_grad(_loss(state, x, y, scale))()
        grads = {**grads, "params": jax.tree.map(lambda g: g / scale, grads["params"])}
        return state.apply_gradients(grads=grads)

    scaled, plain = _newest(step(state, S).fp8), _newest(step(state, 1.0).fp8)
    assert scaled.keys() == plain.keys() and len(plain) == 6
    for path in plain:
        want = plain[path] * np.float32(S) if _role(path) == "grad" else plain[path]
        np.testing.assert_array_equal(scaled[path], want, err_msg=path)
        assert plain[path] > 0


@pytest.mark.parametrize("pack_fp8", [True, False])
def test_linen_flax_dynamic_scale_over_params_and_fp8_gives_the_rule_s_scales(pack_fp8):
    """Flax's own DynamicScale differentiating (params, fp8) divides the whole gradient by
    its loss scale, the FP8 part (JAX's raw cotangents, amax records) included: each
    record reads back its amax all the same, so apply_gradients(fp8_grads=...) gives the
    scales the manual loss-scaled step gives (input and kernel: the unscaled amaxes; the
    gradient: the scaled gradient's, the tensor the backward quantized), bit for bit."""
    _, state, x, y = _linen(pack_fp8)
    dyn = dynamic_scale_lib.DynamicScale()
    scale = float(dyn.scale)

    @jax.jit
    def dyn_step(state, dyn):
        dyn, is_finite, _, (grads, fp8_grads) = dyn.value_and_grad(
            _loss(state, x, y), argnums=(0, 1))(state.params, state.fp8)
        return state.apply_gradients(grads=grads, fp8_grads=fp8_grads), is_finite

    @jax.jit
    def manual_step(state):
        _, grads = state.value_and_grad(_loss(state, x, y, scale))()
        grads = {**grads, "params": jax.tree.map(lambda g: g / scale, grads["params"])}
        return state.apply_gradients(grads=grads)

    new, is_finite = dyn_step(state, dyn)
    assert bool(is_finite)
    got, want = _newest(new.fp8), _newest(manual_step(state).fp8)
    assert got.keys() == want.keys() and len(want) == 6
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    assert_trees_equal(jax_fp8.unpack_states(new.fp8),
                       jax_fp8.unpack_states(manual_step(state).fp8))
    plain = _newest(jax.jit(lambda s: s.apply_gradients(
        grads=s.value_and_grad(_loss(s, x, y))()[1]))(state).fp8)
    for path in want:     # input and kernel: the unscaled step's amaxes
        if _role(path) != "grad":
            np.testing.assert_array_equal(got[path], plain[path], err_msg=path)


def test_linen_flax_dynamic_scale_over_the_params_alone_is_refused_naming_the_fix():
    _, state, x, y = _linen()
    dyn = dynamic_scale_lib.DynamicScale()
    loss_fn = _loss(state, x, y)
    with pytest.raises(ValueError, match=r"Differentiate the FP8 state too.*value_and_grad"):
        dyn.value_and_grad(lambda p: loss_fn(p, state.fp8))(state.params)


@pytest.mark.parametrize("pack_fp8", [True, False])
def test_linen_ema_of_all_variables_evaluates_consistently(pack_fp8):
    """An EMA written over every variable, FP8 state included: its scale and stored
    scale_inv no longer multiply to 1, but the GEMMs dequantize with 1 / scale, so the EMA
    model's output is the FP8 product of the EMA weights (within FP8's error)."""
    model, state, x, y = _linen(pack_fp8)
    step = jax.jit(lambda s: s.apply_gradients(grads=s.value_and_grad(_loss(s, x, y))()[1]))
    ema = {"params": state.params, FP8_COLLECTION: state.fp8}
    for _ in range(4):
        state = step(state)
        ema = jax.tree.map(lambda e, v: 0.5 * e + 0.5 * v, ema,
                           {"params": state.params, FP8_COLLECTION: state.fp8})
    unpacked = jax_fp8.unpack_states(ema[FP8_COLLECTION])
    drift = [float(jnp.max(jnp.abs(s.scale * s.scale_inv - 1)))
             for s in jax.tree.leaves(unpacked, is_leaf=is_state)]
    assert max(drift) > 0.01                          # the stored pair drifted apart
    out = model.apply({"params": ema["params"], FP8_COLLECTION: unpacked}, x)
    exact = _float_mlp(ema["params"], x)
    err = float(jnp.max(jnp.abs(out - exact)))
    assert err < 0.1 * float(jnp.max(jnp.abs(exact)))
    garbage = jax.tree.map(lambda s: s.replace(scale_inv=s.scale_inv * 7.67), unpacked,
                           is_leaf=is_state)
    assert_trees_equal(model.apply({"params": ema["params"], FP8_COLLECTION: garbage}, x), out)


def _float_mlp(params, x):
    h = jax.nn.relu(x @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"])
    return h @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"]


def test_linen_tree_round_trips_and_replicate_keep_the_fp8_gradients():
    _, state, x, y = _linen()
    _, grads = state.value_and_grad(_loss(state, x, y))()
    # One compiled update for every tree (each is passed as the pytree it is, so a tree that
    # lost the FP8 gradients' types would reach apply_gradients as such), not op by op.
    fp8_after = jax.jit(lambda s, g: s.apply_gradients(grads=g).fp8)
    want = fp8_after(state, grads)
    leaves, treedef = jax.tree.flatten(grads)
    again = jax.tree.unflatten(treedef, leaves)
    with_path = jax.tree_util.tree_unflatten(
        treedef, [v for _, v in jax.tree_util.tree_flatten_with_path(grads)[0]])
    for g in (again, with_path, jax.tree.map(lambda a: a, grads),
              jax_utils.unreplicate(jax_utils.replicate(grads)),
              jax.jit(lambda g: g)(grads)):
        assert jax.tree.structure(g) == treedef
        assert_trees_equal(fp8_after(state, g), want)
    replicated = jax_utils.replicate(state)
    assert_trees_equal(jax_utils.unreplicate(replicated).fp8, state.fp8)


def test_linen_microbatch_helpers_run_in_a_module_named_like_optax(tmp_path, monkeypatch):
    """The documented microbatch loop (zeros_like of the FP8 state, combine_fp8_grads)
    written in the user's own module `optax_utils.py`: not mistaken for optax."""
    (tmp_path / "optax_utils.py").write_text(
        "import jax, jax.numpy as jnp, jax_fp8\n"
        "def accumulate(state, loss_fn, xs, ys):\n"
        "    def micro(acc, batch):\n"
        "        _, grads = state.value_and_grad(loss_fn)(*batch)\n"
        "        return {'params': jax.tree.map(jnp.add, acc['params'], grads['params']),\n"
        "                'fp8_meta': jax_fp8.combine_fp8_grads(acc['fp8_meta'],\n"
        "                                                      grads['fp8_meta'])}, None\n"
        "    zeros = {'params': jax.tree.map(jnp.zeros_like, state.params),\n"
        "             'fp8_meta': jax.tree.map(jnp.zeros_like, state.fp8)}\n"
        "    return jax.lax.scan(micro, zeros, (xs, ys))[0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    optax_utils = importlib.import_module("optax_utils")
    try:
        _, state, x, y = _linen()

        def loss_fn(params, fp8, x, y):
            return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2)

        xs, ys = x.reshape(2, 8, 8), y.reshape(2, 8, 4)
        grads = jax.jit(lambda s: optax_utils.accumulate(s, loss_fn, xs, ys))(state)
        per = [state.value_and_grad(loss_fn)(xs[i], ys[i])[1] for i in range(2)]
        want = jax_fp8.combine_fp8_grads(*(g[FP8_COLLECTION] for g in per))
        assert_trees_equal(jax_fp8.amax_cotangents(grads[FP8_COLLECTION]),
                           jax_fp8.amax_cotangents(want))
        state.apply_gradients(grads=grads)
    finally:
        sys.modules.pop("optax_utils", None)


@pytest.mark.parametrize("tx", ["schedule_free", "lookahead_free", "ema_of_params"])
def test_linen_optax_contrib_and_averaging_optimizers_train_params_and_fp8(tx):
    model, state, x, y = _linen()
    txs = {
        "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2),
        "lookahead_free": lambda: optax.chain(optax.adam(1e-2), optax.ema(0.9)),
        "ema_of_params": lambda: optax.chain(optax.sgd(1e-2), optax.ema(0.5, debias=False)),
    }
    state = Fp8TrainState.create(apply_fn=model.apply, params=state.params, fp8=state.fp8,
                                 tx=txs[tx](), recipe=RECIPE)
    step = jax.jit(lambda s: s.apply_gradients(grads=s.value_and_grad(_loss(s, x, y))()[1]))
    for _ in range(2):
        state = step(state)
    jax_fp8.check_fp8_updated(state.fp8)


def _params_by_optax(tx, params, grads_params, steps):
    """The parameters ``tx`` gives from ``grads_params(params)``, run by optax alone."""
    @jax.jit
    def update(g, opt_state, params):
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = update(grads_params(params), opt_state, params)
    return params


@pytest.mark.parametrize("tx", ["prodigy", "dadapt_adamw", "ademamix", "muon", "sam",
                                "schedule_free_adamw"])
def test_linen_optax_contrib_optimizers_give_optax_s_params(tx):
    """optax.contrib optimizers as Fp8TrainState's tx: the parameters optax gives from the
    same parameter gradients, bit for bit, and the FP8 state updated; schedule-free's
    evaluation parameters evaluate in FP8."""
    model, state, x, y = _linen()
    make = {"prodigy": lambda: optax.contrib.prodigy(1e-1),
            "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1e-1),
            "ademamix": lambda: optax.contrib.ademamix(1e-2),
            "muon": lambda: optax.contrib.muon(1e-2),
            "sam": lambda: optax.contrib.sam(optax.sgd(1e-2), optax.sgd(1e-2), sync_period=2),
            "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2)}[tx]
    state = Fp8TrainState.create(apply_fn=model.apply, params=state.params, fp8=state.fp8,
                                 tx=make(), recipe=RECIPE)
    step = jax.jit(lambda s: s.apply_gradients(grads=s.value_and_grad(_loss(s, x, y))()[1]))

    @jax.jit
    def by_optax(s):   # optax on the same gradients; the same program but the FP8 update
        grads = s.value_and_grad(_loss(s, x, y))()[1]["params"]
        updates, opt_state = s.tx.update(grads, s.opt_state, s.params)
        return optax.apply_updates(s.params, updates), opt_state

    new = state
    for _ in range(2):
        want, opt_state = by_optax(new)
        new = step(new)
        assert_trees_equal(new.params, want)
        assert_trees_equal(new.opt_state, opt_state)
    jax_fp8.check_fp8_updated(new.fp8)
    if tx == "schedule_free_adamw":
        eval_params = optax.contrib.schedule_free_eval_params(new.opt_state, new.params)
        out = new.apply_model(eval_params, new.fp8, x)
        exact = _float_mlp(eval_params, x)
        assert float(jnp.max(jnp.abs(out - exact))) < 0.1 * float(jnp.max(jnp.abs(exact)))


def test_linen_optax_lookahead_over_the_params():
    """optax.lookahead: the parameters are LookaheadParams (fast and slow) and, as optax
    defines it, the gradient is the fast parameters' (the FP8 state differentiated too):
    the parameters optax gives, bit for bit, and the FP8 state updated."""
    model, state, x, y = _linen()
    tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    params = optax.LookaheadParams.init_synced(state.params)
    state = Fp8TrainState.create(apply_fn=model.apply, params=params, fp8=state.fp8, tx=tx,
                                 recipe=RECIPE)

    def loss(s):
        def loss_fn(fast, fp8):
            return jnp.mean((s.apply_model(fast, fp8, x) - y) ** 2)
        return loss_fn

    @jax.jit
    def step(s):
        _, grads = jax_fp8.flax.fp8_value_and_grad(loss(s))(s.params.fast, s.fp8)
        return s.apply_gradients(grads=grads)    # {"params": fast grads, "fp8_meta": ...}

    states = [state]
    for _ in range(3):
        states.append(step(states[-1]))
    jax_fp8.check_fp8_updated(states[-1].fp8)
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.all(a == b)),
                                                states[-1].params.slow, params.slow)))
    # optax on the same gradients, in a step of the same program but for the FP8 update.
    @jax.jit
    def by_optax(s):
        _, grads = jax_fp8.flax.fp8_value_and_grad(loss(s))(s.params.fast, s.fp8)
        updates, opt_state = tx.update(grads["params"], s.opt_state, s.params)
        return optax.apply_updates(s.params, updates), opt_state

    for before, after in zip(states, states[1:]):
        want, opt_state = by_optax(before)
        assert_trees_equal(after.params, want)
        assert_trees_equal(after.opt_state, opt_state)


@pytest.mark.parametrize("pack_fp8", [True, False])
def test_linen_polyak_averaging_with_optax_incremental_update(pack_fp8):
    """Polyak averaging by optax.incremental_update over the params: optax's average, bit
    for bit the formula. Over all variables, the FP8 state included, optax is refused
    naming the fix (params only; an average of FP8 states written by hand with
    jax.tree.map evaluates in FP8 with the averaged scales, the test above)."""
    model, state, x, y = _linen(pack_fp8)
    step = jax.jit(lambda s: s.apply_gradients(grads=s.value_and_grad(_loss(s, x, y))()[1]))
    avg = by_hand = state.params
    for _ in range(3):
        state = step(state)
        avg = jax.jit(optax.incremental_update)(state.params, avg, 0.25)
        by_hand = jax.jit(lambda n, o: jax.tree.map(lambda a, b: 0.25 * a + (1.0 - 0.25) * b,
                                                    n, o))(state.params, by_hand)
    assert_trees_equal(avg, by_hand)
    out = state.apply_model(avg, state.fp8, x)
    exact = _float_mlp(avg, x)
    assert float(jnp.max(jnp.abs(out - exact))) < 0.1 * float(jnp.max(jnp.abs(exact)))
    everything = {"params": state.params, FP8_COLLECTION: state.fp8}
    with pytest.raises(ValueError, match=r"optax was given jax_fp8 FP8 scaling states.*"
                                         r"optax on variables\['params'\] only"):
        optax.incremental_update(everything, everything, 0.25)


@pytest.mark.parametrize("pack_fp8", [True, False])
def test_linen_tree_util_round_trips_of_the_state_and_variables(pack_fp8):
    """tree_flatten / tree_unflatten (with paths too) and an identity tree_map of the
    train state and of its variables: the same outputs and the same next step."""
    model, state, x, y = _linen(pack_fp8)
    step = jax.jit(lambda s: s.apply_gradients(grads=s.value_and_grad(_loss(s, x, y))()[1]))
    want, out = step(state), state.apply_model(state.params, state.fp8, x)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    with_path, treedef2 = jax.tree_util.tree_flatten_with_path(state)
    for again in (jax.tree_util.tree_unflatten(treedef, leaves),
                  jax.tree_util.tree_unflatten(treedef2, [v for _, v in with_path]),
                  jax.tree.map(lambda a: a, state), jax_utils.unreplicate(
                      jax_utils.replicate(state))):
        assert type(again.fp8) is type(state.fp8)
        np.testing.assert_array_equal(again.apply_model(again.params, again.fp8, x), out)
        assert_trees_equal(step(again).fp8, want.fp8)
        assert_trees_equal(step(again).params, want.params)
    variables = jax.tree.map(lambda a: a, {"params": state.params, FP8_COLLECTION: state.fp8})
    np.testing.assert_array_equal(model.apply(variables, x), out)


# --------------------------------------------------------------------------------- NNX

def _nnx_loss(scale=1.0):
    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2) * scale
    return loss_fn


def _is_fp8_grad(v):
    return isinstance(v, fnnx.Fp8Grad)


def test_nnx_fp8_gradients_refuse_arithmetic_and_param_only_scaling_is_right():
    x, y = rand(0, (16, 8)), rand(1, (16, 4))
    model = Fp8Mlp(nnx.Rngs(0), recipe=RECIPE)
    _, grads = fnnx.fp8_value_and_grad(_nnx_loss(S))(model, x, y)
    with pytest.raises(TypeError, match=REFUSES_ARITHMETIC):
        jax.jit(lambda g: jax.tree.map(lambda a: a / S, g))(grads)
    with pytest.raises(TypeError, match=REFUSES_ARITHMETIC):
        jax.jit(lambda g: sum(jnp.sum(a ** 2) for a in jax.tree.leaves(g)))(grads)

    def newest(scale):
        m = Fp8Mlp(nnx.Rngs(0), recipe=RECIPE)
        opt = fnnx.Fp8Optimizer(m, optax.sgd(1e-2), wrt=nnx.Param, recipe=RECIPE)

        @nnx.jit
        def step(m, opt):
            _, g = fnnx.fp8_value_and_grad(_nnx_loss(scale))(m, x, y)
            g = jax.tree.map(lambda v: v if _is_fp8_grad(v) else v.replace(v[...] / scale),
                             g, is_leaf=lambda v: isinstance(v, nnx.Variable))
            opt.update(m, g)

        step(m, opt)
        return _newest(fnnx.fp8_state(m).to_pure_dict())

    scaled, plain = newest(S), newest(1.0)
    assert len(plain) == 6
    for path in plain:
        want = plain[path] * np.float32(S) if _role(path) == "grad" else plain[path]
        np.testing.assert_array_equal(scaled[path], want, err_msg=path)


def test_nnx_ema_of_the_model_state_evaluates_consistently():
    x, y = rand(0, (16, 8)), rand(1, (16, 4))
    model = Fp8Mlp(nnx.Rngs(0), recipe=RECIPE)
    opt = fnnx.Fp8Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param, recipe=RECIPE)

    @nnx.jit
    def step(m, opt):
        _, g = fnnx.fp8_value_and_grad(_nnx_loss())(m, x, y)
        opt.update(m, g)

    ema = jax.tree.map(jnp.copy, nnx.state(model))
    for _ in range(4):
        step(model, opt)
        ema = jax.tree.map(lambda e, v: 0.5 * e + 0.5 * v, ema, nnx.state(model))
    ema_model = Fp8Mlp(nnx.Rngs(1), recipe=RECIPE)
    nnx.update(ema_model, ema)
    out = ema_model(x)
    p = nnx.state(ema_model, nnx.Param)
    h = jax.nn.relu(x @ p["l1"]["kernel"][...] + p["l1"]["bias"][...])
    exact = h @ p["l2"]["kernel"][...] + p["l2"]["bias"][...]
    assert float(jnp.max(jnp.abs(out - exact))) < 0.1 * float(jnp.max(jnp.abs(exact)))


def test_nnx_tree_util_round_trips_and_optax_contrib():
    """NNX: the model's state through tree_flatten / unflatten and an identity tree_map,
    merged back, computes the same; an optax.contrib optimizer in Fp8Optimizer gives
    optax's parameters from the same gradients and updates the FP8 state."""
    x, y = rand(0, (16, 8)), rand(1, (16, 4))
    model = Fp8Mlp(nnx.Rngs(0), recipe=RECIPE)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    for again in (jax.tree_util.tree_unflatten(treedef, leaves), jax.tree.map(lambda a: a, state)):
        np.testing.assert_array_equal(nnx.merge(graphdef, again)(x), model(x))
    opt = fnnx.Fp8Optimizer(model, optax.contrib.prodigy(1e-1), wrt=nnx.Param, recipe=RECIPE)
    params_0 = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    grads_seen = []

    @nnx.jit
    def step(m, o):
        _, g = fnnx.fp8_value_and_grad(_nnx_loss())(m, x, y)
        o.update(m, g)
        return nnx.state(g, lambda path, v: not _is_fp8_grad(v))

    for _ in range(2):
        grads_seen.append(step(model, opt))
    fnnx.check_fp8_updated(model)
    it = iter(grads_seen)
    want = _params_by_optax(optax.contrib.prodigy(1e-1), params_0, lambda p: next(it), 2)
    assert_trees_equal(nnx.state(model, nnx.Param), want)
