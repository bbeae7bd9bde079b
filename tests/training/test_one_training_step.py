"""One training step for every adapter (jax_fp8._training_step): linen's `Fp8TrainState`, NNX's
`apply_gradients` / `Fp8Optimizer` (with and without optax.MultiSteps) and Equinox's
`apply_updates` refuse the same mistakes in the same order, each naming its own framework's
fix; the core functions called from plain JAX name plain JAX's."""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
import jax_fp8.equinox as jfe
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, nnx as fnnx

pytestmark = pytest.mark.usefixtures("on_cpu")

X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
RECIPE = jax_fp8.DelayedScaling(history_len=4)
OTHER = jax_fp8.DelayedScaling(history_len=8)   # not the layers' recipe
FROZEN = "with jax_fp8.frozen_scales():"

# What names a framework's fix; a message for one framework holds none of the others'.
SPELLINGS = {
    "linen": ("Fp8TrainState", "state.value_and_grad", "state.apply_gradients", "nn.Dense",
              "grads['params']"),
    "NNX": ("nnx.", "Fp8Optimizer"),
    "Equinox": ("eqx.", "jax_fp8.equinox"),
}
PLAIN_FORBIDDEN = (*(w for ws in SPELLINGS.values() for w in ws), "flax", "Flax", "linen",
                   "NNX", "Equinox", "variables=model.init")


def assert_names(text, framework, *want):
    for w in want:
        assert w in text, (w, text)
    for other, words in SPELLINGS.items():
        if other != framework:
            for w in words:
                assert w not in text, (framework, w, text)


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(u), np.asarray(v))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# ---------------------------------------------------------------- the three adapters' steps
# Each case: make(recipe of the step) -> (run(fp8_grads_given), snapshot()); run performs
# one step and snapshot() reads everything a step may change.

def _linen_state(tx):
    model = nn.Dense(4, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=RECIPE))
    return Fp8TrainState.create(apply_fn=model.apply, variables=model.init(jax.random.key(0), X),
                                tx=tx, recipe=RECIPE)


def _or(new, old):
    return old if new is None else new


def _linen(step_recipe, tx):
    state = _linen_state(tx).replace(recipe=step_recipe)
    loss = lambda p, f: jnp.sum(state.apply_model(p, f, X) ** 2)  # noqa: E731

    def run(with_fp8):
        if with_fp8:
            _, grads = state.value_and_grad(loss)()
        else:
            with jax_fp8.frozen_scales():
                grads = jax.grad(loss)(state.params, state.fp8)
        return state.apply_gradients(grads=grads)

    return run, lambda new=None: _or(new, state).params, lambda new=None: _or(new, state).fp8


def _nnx(step_recipe, tx, fp8_optimizer):
    model = fnnx.Fp8Linear(8, 4, recipe=RECIPE, rngs=nnx.Rngs(0))
    if fp8_optimizer:
        opt = fnnx.Fp8Optimizer(model, tx, wrt=nnx.Param, recipe=step_recipe)
        update = opt.update
    else:
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        update = functools.partial(fnnx.apply_gradients, optimizer=opt, recipe=step_recipe)
    loss = lambda m: jnp.sum(m(X) ** 2)  # noqa: E731

    def run(with_fp8):
        if with_fp8:
            _, grads = fnnx.fp8_value_and_grad(loss)(model)
        else:
            with jax_fp8.frozen_scales():
                grads = nnx.grad(loss)(model)
        if fp8_optimizer:
            update(model, grads)
        else:
            update(model, grads=grads)
        return None

    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731
    return (run, lambda _=None: copy(nnx.state(model, nnx.Param)),
            lambda _=None: copy((nnx.state(model, fnnx.Fp8State), nnx.state(opt))))


def _equinox(step_recipe, tx):
    model = jfe.Fp8Linear(8, 4, recipe=RECIPE, key=jax.random.key(0))
    if step_recipe != RECIPE:   # a state updated with a recipe its meta was not made by
        model = eqx.tree_at(lambda m: m.fp8, model, jfe.Fp8State(model.fp8.meta, step_recipe))
    opt_state = tx.init(jfe.params(model))
    loss = lambda m: jnp.sum(jax.vmap(m)(X) ** 2)  # noqa: E731

    def run(with_fp8):
        if with_fp8:
            grads = eqx.filter_grad(loss)(model)
        else:
            with jax_fp8.frozen_scales():
                grads = jfe.params(eqx.filter_grad(loss)(model))
        updates, _ = tx.update(jfe.params(grads), opt_state, jfe.params(model))
        return jfe.apply_updates(model, updates, grads)

    return run, lambda new=None: _or(new, model).weight, lambda new=None: _or(new, model).fp8


SGD = lambda: optax.sgd(0.1)  # noqa: E731
MULTI = lambda: optax.MultiSteps(optax.sgd(0.1), 2)  # noqa: E731
CASES = {   # id: (framework, the function named first, make)
    "linen": ("linen", "Fp8TrainState.apply_gradients", lambda r: _linen(r, SGD())),
    "linen_multi_steps": ("linen", "Fp8TrainState.apply_gradients",
                          lambda r: _linen(r, MULTI())),
    "nnx_apply_gradients": ("NNX", "apply_gradients", lambda r: _nnx(r, SGD(), False)),
    "nnx_fp8_optimizer": ("NNX", "Fp8Optimizer.update", lambda r: _nnx(r, SGD(), True)),
    "nnx_fp8_optimizer_multi_steps": ("NNX", "Fp8Optimizer.update",
                                      lambda r: _nnx(r, MULTI(), True)),
    "equinox": ("Equinox", "jax_fp8.equinox.apply_updates", lambda r: _equinox(r, SGD())),
}
FIXES = {   # each framework's own spelling of getting the FP8 gradients to the step
    "linen": ("state.value_and_grad(loss_fn)", "state.apply_gradients(grads=grads)"),
    "NNX": ("jax_fp8.flax.nnx.fp8_value_and_grad(loss_fn)(model, ...)",
            "Fp8Optimizer(model, tx, wrt=nnx.Param, recipe=recipe)"),
    "Equinox": ("eqx.filter_value_and_grad(loss_fn)(model, ...)",
                "jax_fp8.equinox.apply_updates(model, updates, grads)"),
}
RECIPE_FIXES = {
    "linen": "pass `recipe=` to `Fp8TrainState.create(..., recipe=recipe)`",
    "NNX": "pass `recipe=` to `jax_fp8.flax.nnx.apply_gradients(model, optimizer, grads, recipe)`",
    "Equinox": "`Fp8State.create(recipe)`",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_fp8_gradients_names_the_frameworks_fix(case):
    framework, call, make = CASES[case]
    run, _, _ = make(RECIPE)
    with pytest.raises(ValueError, match=rf"^{call}: no FP8 gradients for the delayed-scaling "
                                         r"states of .*\(3 delayed-scaling states in all\)"
                   ) as err:
        run(with_fp8=False)
    assert_names(str(err.value), framework, *FIXES[framework], FROZEN)


@pytest.mark.parametrize("case", sorted(CASES))
def test_frozen_scales_keeps_the_fp8_state_and_steps_the_optimizer(case):
    _, _, make = CASES[case]
    run, params, fp8 = make(RECIPE)
    params_before, fp8_before = params(), fp8()
    with jax_fp8.frozen_scales():
        new = run(with_fp8=False)
    fp8_after = fp8(new)
    if case.startswith("nnx"):   # (the FP8 states, the optimizer state): keep the former
        fp8_after, fp8_before = fp8_after[0], fp8_before[0]
    assert leaves_equal(fp8_after, fp8_before)
    if "multi_steps" not in case:   # (MultiSteps applies on the second call)
        assert not leaves_equal(params(new), params_before)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_recipe_mismatch_names_the_frameworks_fix_before_anything_changes(case):
    # With no FP8 gradients either: the recipe is checked first, in every adapter.
    framework, call, make = CASES[case]
    run, params, fp8 = make(OTHER)
    params_before, fp8_before = params(), fp8()
    for with_fp8 in (False, True):
        with pytest.raises(ValueError, match=rf"^{call}: .* does not follow the recipe") as err:
            run(with_fp8)
        assert_names(str(err.value), framework, RECIPE_FIXES[framework])
    assert leaves_equal(params(), params_before)   # the optimizer did not step
    assert leaves_equal(fp8(), fp8_before)


def test_linen_create_names_linen_recipe_fix():
    model = nn.Dense(4, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=RECIPE))
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"^Fp8TrainState.create: fp8.* does not follow") as e:
        Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1),
                             recipe=OTHER)
    assert_names(str(e.value), "linen", RECIPE_FIXES["linen"])


def test_nnx_plain_optimizer_under_multi_steps_is_refused_after_the_recipe_check():
    run, params, fp8 = _nnx(RECIPE, MULTI(), fp8_optimizer=False)
    before = params(), fp8()
    with pytest.raises(ValueError, match=r"^apply_gradients: the optimizer wraps "
                                         r"optax.MultiSteps") as err:
        run(with_fp8=True)
    assert_names(str(err.value), "NNX", "Fp8Optimizer(model, tx", "combine_fp8_grads")
    assert leaves_equal(params(), before[0]) and leaves_equal(fp8(), before[1])
    run, _, _ = _nnx(OTHER, MULTI(), fp8_optimizer=False)
    with pytest.raises(ValueError, match="does not follow the recipe"):
        run(with_fp8=True)


@pytest.mark.parametrize("framework", ["linen", "NNX", "Equinox"])
def test_check_fp8_updated_names_the_frameworks_loop(framework):
    if framework == "linen":   # the whole train state: its own hints
        check = functools.partial(jax_fp8.check_fp8_updated, _linen_state(SGD()))
    elif framework == "NNX":
        check = functools.partial(fnnx.check_fp8_updated,
                                  fnnx.Fp8Linear(8, 4, recipe=RECIPE, rngs=nnx.Rngs(0)))
    else:
        check = functools.partial(jfe.check_fp8_updated,
                                  jfe.Fp8Linear(8, 4, recipe=RECIPE, key=jax.random.key(0)))
    with pytest.raises(ValueError, match="none of its 3 delayed-scaling states") as err:
        check()
    assert_names(str(err.value), framework, *FIXES[framework][:1])


# ------------------------------------------------------------------------------ plain JAX

def _plain_loss(w, meta):
    out, _ = jax_fp8.fp8_dot_general(X, w, (((1,), (0,)), ((), ())), meta)
    return jnp.sum(out ** 2)


def assert_plain(text, *want):
    for w in want:
        assert w in text, (w, text)
    for w in PLAIN_FORBIDDEN:
        assert w not in text, (w, text)


def test_plain_jax_core_functions_name_plain_jax_fixes():
    w = jnp.ones((8, 4))
    meta = jax_fp8.Fp8Meta.create(RECIPE)
    _, fp8_grads = jax.grad(_plain_loss, argnums=(0, 1))(w, meta)
    with pytest.raises(ValueError, match="does not follow the recipe") as err:   # recipe
        jax_fp8.new_fp8_state(meta, fp8_grads, OTHER)
    assert_plain(str(err.value), "jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)",
                 "jax_fp8.Fp8Meta.create(recipe)")
    with pytest.raises(ValueError, match="is not, so the amaxes") as err:   # dropped amaxes
        jax.grad(_plain_loss)(w, meta)
    assert_plain(str(err.value), "jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8)",
                 "jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)", FROZEN)
    rebuilt = jax.tree.map(lambda g: jnp.zeros(g.shape),   # tree code over AmaxGrads
                           jax_fp8.fp8_grads_from_cotangents(fp8_grads))
    with pytest.raises(TypeError, match="holds a float32 array") as err:
        jax_fp8.combine_fp8_grads(rebuilt, rebuilt)
    assert_plain(str(err.value), "the parameter gradients")
    twice = lambda w, m: _plain_loss(w, m) + _plain_loss(w, m)  # noqa: E731
    with pytest.raises(ValueError, match="already given to another FP8 op") as err:
        jax.grad(twice, argnums=(0, 1))(w, meta)
    assert_plain(str(err.value), "apply it once")


def test_plain_jax_without_an_adapter_imported_gets_plain_jax_fixes(monkeypatch):
    # check_fp8_updated and optax's refusal cannot tell who wrote the loop: they name plain
    # JAX's fix and those of the adapters imported; a plain-JAX program imports none.
    meta = jax_fp8.Fp8Meta.create(RECIPE)
    with pytest.raises(ValueError, match="none of its 3") as err:   # never updated
        jax_fp8.check_fp8_updated([meta])
    assert "Fp8TrainState" in str(err.value)   # this process imports the adapters
    monkeypatch.setattr(jax_fp8._hints, "_ADAPTERS", [])
    with pytest.raises(ValueError, match="none of its 3") as err:
        jax_fp8.check_fp8_updated([meta])
    assert_plain(str(err.value), "jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)")
    with pytest.raises(ValueError, match="optax was given jax_fp8") as err:
        optax.adam(0.1).init([meta])
    assert_plain(str(err.value), "optim.init(params)")
