"""Models as users bring them to the FP8 layers and to `fp8_model`: evaluation with a
read-only FP8 collection (jit, a retrace, eager, nn.cond, a weight-tied nn.scan), layers
with a GEMM of their own, a module's own GEMMs keyed by the weight they multiply, and
partitioned parameters under a mesh (8 host CPU devices, in a subprocess)."""

from __future__ import annotations

import functools
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization

import helpers
import jax_fp8
from helpers import assert_trees_equal, train_steps
from jax_fp8.flax import (
    FP8_COLLECTION,
    Fp8DotGeneral,
    Fp8Einsum,
    Fp8Rule,
    Fp8TrainState,
    fp8_model,
    nnx as fnnx,
)

KEY = jax.random.key(0)
RECIPE = jax_fp8.DelayedScaling(history_len=4)
RULE = Fp8Rule(recipe=RECIPE, min_fp8_flops=0)
IS_STATE = lambda x: isinstance(x, jax_fp8.ScalingState)  # noqa: E731


def _staged(fp8_grads):
    return jax_fp8.amax_cotangents(fp8_grads)


# ------------------------------------------------- evaluation, FP8 collection read-only

def test_eval_with_a_read_only_collection_jitted_retraced_and_eager():
    m = nn.Dense(4, dot_general_cls=Fp8DotGeneral)
    x = jnp.ones((4, 8))
    v = m.init(jax.random.key(0), x)
    predict = jax.jit(lambda x: m.apply(v, x))
    want = m.apply(v, x, mutable=[FP8_COLLECTION])[0]
    with jax.checking_leaks():               # no traced value is kept beyond its trace
        np.testing.assert_array_equal(predict(x), want)
    np.testing.assert_array_equal(predict(jnp.ones((2, 8))), want[:2])   # a retrace
    np.testing.assert_array_equal(m.apply(v, x), want)                   # eager
    np.testing.assert_array_equal(m.apply(v, x, mutable=[FP8_COLLECTION])[0], want)
    bound = m.bind(v)                        # one bound module across traces
    f = jax.jit(lambda x: bound(x))
    np.testing.assert_array_equal(f(x), want)
    np.testing.assert_array_equal(f(jnp.ones((2, 8))), want[:2])
    np.testing.assert_array_equal(bound(x), want)


class _Cond(nn.Module):
    flag: bool

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(4, dot_general_cls=Fp8DotGeneral)
        return nn.cond(self.flag, lambda m, x: m(x), lambda m, x: m(2 * x), dense, x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_eval_under_nn_cond(jit):
    x = jax.random.normal(jax.random.key(1), (4, 8))
    v = _Cond(True).init(KEY, x)
    dense = nn.Dense(4, dot_general_cls=Fp8DotGeneral)
    inner = {"params": v["params"]["Dense_0"], FP8_COLLECTION: v[FP8_COLLECTION]["Dense_0"]}
    for flag, arg in ((True, x), (False, 2 * x)):
        apply = _Cond(flag).apply
        mutable = functools.partial(apply, mutable=[FP8_COLLECTION])
        apply, mutable = (jax.jit(apply), jax.jit(mutable)) if jit else (apply, mutable)
        want = dense.apply(inner, arg)
        np.testing.assert_array_equal(apply(v, x), want)
        np.testing.assert_array_equal(apply(v, x), want)            # a second call
        np.testing.assert_array_equal(mutable(v, x)[0], want)       # mutable after


class _Fails(nn.Module):
    @nn.compact
    def __call__(self, x, fail):
        y = nn.Dense(4, dot_general_cls=Fp8DotGeneral)(x)
        if fail:
            raise RuntimeError("fails after the FP8 layer")
        return y


def test_a_failed_apply_leaves_nothing_behind():
    x = jax.random.normal(jax.random.key(1), (4, 8))
    model = _Fails()
    v = model.init(KEY, x, False)
    want = model.apply(v, x, False)
    for run in (lambda: jax.jit(model.apply, static_argnums=2)(v, x, True),
                lambda: model.apply(v, x, True)):
        with pytest.raises(RuntimeError, match="fails after"):
            run()
        np.testing.assert_array_equal(model.apply(v, x, False), want)
        np.testing.assert_array_equal(jax.jit(model.apply, static_argnums=2)(v, x, False),
                                      want)
        np.testing.assert_array_equal(
            model.apply(v, x, False, mutable=[FP8_COLLECTION])[0], want)


class _Body(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return nn.Dense(8, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=RECIPE),
                        name="dense")(c), None


class _Tied(nn.Module):
    """One Dense applied 3 times, its params and FP8 state broadcast over nn.scan."""

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_Body, variable_broadcast=["params", FP8_COLLECTION],
                       split_rngs={"params": False}, length=3)
        return scan(name="tied")(x, None)[0]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_weight_tied_scan_broadcasting_the_fp8_collection(jit):
    x = jax.random.normal(jax.random.key(1), (4, 8))
    model = _Tied()
    init = jax.jit(model.init) if jit else model.init
    v = init(KEY, x)
    hist = v[FP8_COLLECTION]["tied"]["dense"]["Fp8DotGeneral_0"]["input"].amax_history
    assert hist.shape == (4,) and not np.any(hist)        # one fresh state, no layer axis
    dense = nn.Dense(8, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=RECIPE))
    inner = {"params": v["params"]["tied"]["dense"],
             FP8_COLLECTION: v[FP8_COLLECTION]["tied"]["dense"]}
    want = x
    for _ in range(3):
        want = dense.apply(inner, want)
    apply = jax.jit(model.apply) if jit else model.apply
    np.testing.assert_array_equal(apply(v, x), want)
    np.testing.assert_array_equal(apply(v, x), want)


# --------------------------------------------------------- a layer's own dot_general

def _highest(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
             **kwargs):
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=preferred_element_type)


class _HighestCls:
    """A user's dot_general_cls (a plain class)."""

    def __call__(self, *args, **kwargs):
        return _highest(*args, **kwargs)


class _HighestModule(nn.Module):
    """A user's dot_general_cls (a linen module)."""

    @nn.compact
    def __call__(self, *args, **kwargs):
        return _highest(*args, **kwargs)


@pytest.mark.parametrize("layer", [
    nn.Dense(8, dot_general=_highest),
    nn.Dense(8, dot_general_cls=_HighestCls),
    nn.Dense(8, dot_general_cls=_HighestModule),
    nn.DenseGeneral((2, 4), dot_general=_highest),
    nn.DenseGeneral((2, 4), dot_general_cls=_HighestModule),
], ids=["Dense-dot_general", "Dense-cls", "Dense-module_cls", "DenseGeneral-dot_general",
        "DenseGeneral-module_cls"])
@pytest.mark.parametrize("activations", [False, True], ids=["weights", "activations"])
def test_linen_a_layer_with_its_own_dot_general_stays_as_it_is(layer, activations):
    x = jax.random.normal(jax.random.key(1), (4, 16)) * 10
    model = fp8_model(layer, Fp8Rule(recipe=RECIPE, activations=activations, min_fp8_flops=0))
    v = model.init(KEY, x)
    assert FP8_COLLECTION not in v
    assert_trees_equal(v, layer.init(KEY, x))
    np.testing.assert_array_equal(model.apply(v, x), layer.apply(v, x))
    np.testing.assert_array_equal(jax.jit(model.apply)(v, x), jax.jit(layer.apply)(v, x))


class _NnxOwn(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 8, dot_general=_highest, rngs=rngs)
        self.general = nnx.LinearGeneral(8, (2, 4), dot_general=_highest, rngs=rngs)
        self.einsum = nnx.Einsum("bd,dh->bh", (8, 8), einsum_op=functools.partial(
            jnp.einsum, precision=jax.lax.Precision.HIGHEST), rngs=rngs)

    def __call__(self, x):
        return self.general(self.einsum(self.linear(x))).reshape(x.shape[0], 8)


def test_nnx_a_layer_with_its_own_dot_general_stays_as_it_is():
    x = jax.random.normal(jax.random.key(1), (4, 16)) * 10
    model = fp8_model(_NnxOwn(nnx.Rngs(0)), RULE, x)
    assert not jax.tree.leaves(fnnx.fp8_state(model))
    np.testing.assert_array_equal(model(x), _NnxOwn(nnx.Rngs(0))(x))


# ------------------------------------------- a module's own GEMMs, keyed by their weight

class _Branchy(nn.Module):
    """``if use_b: x = x @ wb`` then ``x @ wa``; written by hand with a state per weight."""

    use_b: bool
    by_hand: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(10.0)
        wb = self.param("wb", init, (8, 8))
        wa = self.param("wa", nn.initializers.normal(1000.0), (8, 8))
        einsum = (lambda w, name: functools.partial(Fp8Einsum(recipe=RECIPE, name=name),
                                                    "bd,dh->bh")) if self.by_hand else \
            (lambda w, name: functools.partial(jnp.einsum, "bd,dh->bh"))
        if self.use_b:
            x = einsum(wb, "wb_fp8")(x, wb)
        return einsum(wa, "wa_fp8")(x, wa)


def _linen_train(model, v, x, steps=3):
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(1e-9),
                                 recipe=RECIPE)

    @jax.jit
    def step(state):
        def loss_fn(params, fp8):
            return jnp.mean(state.apply_model(params, fp8, x) ** 2)
        _, grads = state.value_and_grad(loss_fn)()
        return state.apply_gradients(grads=grads)

    for _ in range(steps):
        state = step(state)
    return state


def test_linen_own_gemms_take_the_state_of_their_weight_across_branches():
    x = jax.random.normal(jax.random.key(1), (4, 8))
    conv_b, conv_a = fp8_model(_Branchy(True), RULE), fp8_model(_Branchy(False), RULE)
    hand_b, hand_a = _Branchy(True, True), _Branchy(False, True)
    v = conv_b.init(KEY, x)
    assert_trees_equal(v, hand_b.init(KEY, x))
    assert sorted(v[FP8_COLLECTION]) == ["wa_fp8", "wb_fp8"]
    state, state_h = _linen_train(conv_a, v, x), _linen_train(hand_a, v, x)  # without wb
    assert_trees_equal(state.fp8, state_h.fp8)
    fp8 = jax_fp8.unpack_states(state.fp8)
    assert float(fp8["wa_fp8"]["kernel"].scale) != 1.0   # wa's state trained, wb's not
    assert float(fp8["wb_fp8"]["kernel"].scale) == 1.0
    got = state.apply_model(state.params, state.fp8, x)  # conv_a's apply_fn: use_b=False
    np.testing.assert_array_equal(got, state_h.apply_model(state_h.params, state_h.fp8, x))
    # Now with wb: quantized with its own state, as in the hand-written model.
    variables = {"params": state.params, FP8_COLLECTION: fp8}
    np.testing.assert_array_equal(conv_b.apply(variables, x), hand_b.apply(variables, x))
    np.testing.assert_array_equal(jax.jit(conv_b.apply)(variables, x),
                                  jax.jit(hand_b.apply)(variables, x))


class _Twice(nn.Module):
    """One weight multiplied twice: by an einsum and by a dot_general."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (8, 8))
        h = jnp.einsum("bd,dh->bh", x, w)
        return jax.lax.dot_general(3 * h, w, (((1,), (0,)), ((), ())))


def test_linen_one_weight_multiplied_twice_has_one_state_and_the_max_amax():
    x = jax.random.normal(jax.random.key(1), (4, 8))
    model = fp8_model(_Twice(), RULE)
    v = model.init(KEY, x)
    assert list(v[FP8_COLLECTION]) == ["w_fp8"]
    h = jnp.einsum("bd,dh->bh", x, v["params"]["w"])

    for mutable in (True, False):
        def loss(fp8, mutable=mutable):
            variables = {"params": v["params"], FP8_COLLECTION: fp8}
            y = (model.apply(variables, x, mutable=[FP8_COLLECTION])[0] if mutable
                 else model.apply(variables, x))
            return jnp.sum(y)
        staged = _staged(jax.jit(jax.grad(loss))(v[FP8_COLLECTION]))["w_fp8"]
        # The second use's input (3 h, FP8-rounded as the first GEMM's output) is larger.
        assert float(staged["input"]) >= float(jnp.max(jnp.abs(x)))
        np.testing.assert_allclose(float(staged["input"]), 3 * float(jnp.max(jnp.abs(h))),
                                   rtol=0.07)   # h from an FP8 GEMM: e4m3 rounding
        assert float(staged["kernel"]) == float(jnp.max(jnp.abs(v["params"]["w"])))


def test_linen_old_call_order_names_do_not_restore_into_weight_keyed_states():
    """A checkpoint of the layout before weight keys (Fp8Einsum_0, ...) is refused at
    restore time with the state named."""
    x = jax.random.normal(jax.random.key(1), (4, 8))

    class Old(nn.Module):                  # the former converted layout: by call order
        @nn.compact
        def __call__(self, x):
            wb = self.param("wb", nn.initializers.lecun_normal(), (8, 8))
            wa = self.param("wa", nn.initializers.lecun_normal(), (8, 8))
            x = Fp8Einsum(recipe=RECIPE)("bd,dh->bh", x, wb)
            return Fp8Einsum(recipe=RECIPE)("bd,dh->bh", x, wa)

    old = jax_fp8.pack_states(Old().init(KEY, x)[FP8_COLLECTION])
    new = jax_fp8.pack_states(fp8_model(_Branchy(True), RULE).init(KEY, x)[FP8_COLLECTION])
    with pytest.raises(ValueError, match=r"\['wa_fp8'\].* is not in the checkpoint"):
        serialization.from_bytes({"fp8": new}, serialization.to_bytes({"fp8": old}))


class _NnxBranchy(nnx.Module):
    def __init__(self, rngs, by_hand=False):
        self.wb = nnx.Param(10 * jax.random.normal(rngs.params(), (8, 8)))
        self.wa = nnx.Param(1000 * jax.random.normal(rngs.params(), (8, 8)))
        if by_hand:
            self.wb_fp8, self.wa_fp8 = fnnx.Fp8Einsum(RECIPE), fnnx.Fp8Einsum(RECIPE)
        self.by_hand = by_hand

    def __call__(self, x, use_b):
        einsum = (lambda name: getattr(self, name)) if self.by_hand else \
            (lambda name: jnp.einsum)
        if use_b:
            x = einsum("wb_fp8")("bd,dh->bh", x, self.wb[...])
        return einsum("wa_fp8")("bd,dh->bh", x, self.wa[...])


def _nnx_train(model, x, use_b, steps=3):
    optimizer = fnnx.Fp8Optimizer(model, optax.sgd(1e-9), wrt=nnx.Param, recipe=RECIPE)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = fnnx.fp8_value_and_grad(
            lambda m: jnp.mean(m(x, use_b) ** 2))(model)
        optimizer.update(model, grads)

    for _ in range(steps):
        step(model, optimizer)


def test_nnx_own_gemms_take_the_state_of_their_weight_across_branches():
    x = jax.random.normal(jax.random.key(1), (4, 8))
    model = fp8_model(_NnxBranchy(nnx.Rngs(0)), RULE, x, False)   # wb unseen
    by_hand = _NnxBranchy(nnx.Rngs(0), by_hand=True)
    assert hasattr(model, "wa_fp8") and not hasattr(model, "wb_fp8")
    _nnx_train(model, x, False)
    _nnx_train(by_hand, x, False)
    assert float(model.wa_fp8.kernel.get_value().scale) != 1.0
    with pytest.raises(ValueError, match="example inputs"):        # unseen inside jit
        nnx.jit(lambda m, x: m(x, True))(model, x)
    got = model(x, True)             # eager: wb gets its own fresh state
    assert float(model.wb_fp8.kernel.get_value().scale) == 1.0
    np.testing.assert_array_equal(got, by_hand(x, True))
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x, True))(model, x),
                                  nnx.jit(lambda m, x: m(x, True))(by_hand, x))


class _NnxTwice(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (8, 8)))

    def __call__(self, x):
        h = jnp.einsum("bd,dh->bh", x, self.w[...])
        return jax.lax.dot_general(3 * h, self.w[...], (((1,), (0,)), ((), ())))


def test_nnx_one_weight_multiplied_twice_has_one_state_and_the_max_amax():
    x = jax.random.normal(jax.random.key(1), (4, 8))
    model = fp8_model(_NnxTwice(nnx.Rngs(0)), RULE, x)
    assert isinstance(model.w_fp8, fnnx.Fp8Einsum) and len(
        jax.tree.leaves(fnnx.fp8_state(model), is_leaf=IS_STATE)) == 3
    _, grads = fnnx.fp8_value_and_grad(lambda m: jnp.sum(m(x)))(model)
    staged = _staged(fnnx.fp8_state(grads))["w_fp8"]
    h = jnp.einsum("bd,dh->bh", x, model.w[...])
    np.testing.assert_allclose(float(staged["input"]), 3 * float(jnp.max(jnp.abs(h))),
                               rtol=0.07)
    assert float(staged["kernel"]) == float(jnp.max(jnp.abs(model.w[...])))


# ------------------------------------------- partitioned parameters under a mesh (8 CPUs)

class _Partitioned(nn.Module):
    """MaxText-style: parameters annotated with nn.with_partitioning, multiplied in the
    module's own einsum / dot_general."""

    by_hand: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w1 = self.param("w1", nn.with_partitioning(init, (None, "model")), (16, 32))
        w2 = self.param("w2", nn.with_partitioning(init, ("model", None)), (32, 16))
        if self.by_hand:
            h = Fp8Einsum(recipe=RECIPE, name="w1_fp8")("bd,dh->bh", x, w1)
            dg = Fp8DotGeneral(recipe=RECIPE, name="w2_fp8")
            return dg(nn.relu(h), w2, (((1,), (0,)), ((), ())))
        h = jnp.einsum("bd,dh->bh", x, w1)
        return jax.lax.dot_general(nn.relu(h), w2, (((1,), (0,)), ((), ())))


def _mesh_worker():
    """Runs in a fresh process with 8 host CPU devices (helpers.run_8_device_worker); prints
    the check's outcome on its RESULTS line."""
    results = {}

    @helpers.recorder(results)
    def linen_partitioned_params_under_a_mesh():
        mesh = jax.make_mesh((2, 4), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        x = jax.random.normal(jax.random.key(1), (8, 16))
        y = jax.random.normal(jax.random.key(2), (8, 16))
        conv, hand = fp8_model(_Partitioned(), RULE), _Partitioned(by_hand=True)
        with jax.set_mesh(mesh):
            v, vh = jax.jit(conv.init)(KEY, x), jax.jit(hand.init)(KEY, x)
            assert_trees_equal(nn.meta.unbox(v), nn.meta.unbox(vh))
            assert sorted(v[FP8_COLLECTION]) == ["w1_fp8", "w2_fp8"], list(v)
            out = jax.jit(conv.apply)(v, x)
            np.testing.assert_array_equal(out, jax.jit(hand.apply)(vh, x))
            exact = jax.jit(_Partitioned().apply)(v, x)
            assert np.any(np.asarray(out) != np.asarray(exact)), "not converted"
            finals = []
            for model, variables in ((conv, v), (hand, vh)):
                params, fp8 = nn.meta.unbox(variables["params"]), variables[FP8_COLLECTION]
                state = Fp8TrainState.create(apply_fn=model.apply, params=params, fp8=fp8,
                                             tx=optax.adam(1e-2), recipe=RECIPE)
                losses, state = train_steps(state, x, y, steps=3)
                finals.append(([float(loss) for loss in losses], state.params,
                               jax_fp8.unpack_states(state.fp8)))
            assert finals[0][0] == finals[1][0], (finals[0][0], finals[1][0])
            assert_trees_equal(finals[0][1], finals[1][1])
            assert_trees_equal(finals[0][2], finals[1][2])

    print("RESULTS " + json.dumps(results))


def test_linen_partitioned_params_under_a_mesh_equal_the_hand_written_model():
    results = helpers.run_8_device_worker("test_conversion_cases.py", "mesh")
    result = results["linen_partitioned_params_under_a_mesh"]
    if result != "ok":
        pytest.fail(result, pytrace=False)


if __name__ == "__main__" and sys.argv[1:] == ["mesh"]:
    assert jax.device_count() == 8, jax.devices()
    _mesh_worker()
