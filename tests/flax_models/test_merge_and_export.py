"""NNX's ``nnx.merge(graphdef, leaves)`` on an FP8 model, and ``jax.export`` of functions
taking and returning the packed FP8 state (linen's `PackedCollection`, and `PackedStates`
of a list of Fp8Metas)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import core as flax_core, nnx

import jax_fp8
from helpers import assert_trees_equal, rand
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, nnx as fnnx
from jax_fp8.packing import PackedCollection
from nnx_mlp import Fp8Mlp

RECIPE = jax_fp8.DelayedScaling(history_len=4)   # HYBRID: E4M3 and E5M2 groups

pytestmark = pytest.mark.usefixtures("on_cpu")


X, Y = rand(0, (16, 8)), rand(1, (16, 4))


# ------------------------------------------------------------------ nnx.merge from leaves

def _trained_net():
    """A model whose FP8 states were updated twice (scales other than 1)."""
    model = Fp8Mlp(nnx.Rngs(0), recipe=RECIPE)
    opt = fnnx.Fp8Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param, recipe=RECIPE)

    @nnx.jit
    def step(model, opt):
        _, grads = fnnx.fp8_value_and_grad(
            lambda m, x, y: jnp.mean((m(x) - y) ** 2))(model, X, Y)
        opt.update(model, grads)

    for _ in range(2):
        step(model, opt)
    return model


def test_nnx_merge_takes_one_leaf_per_variable_as_flax_defines_it():
    """``nnx.merge(graphdef, leaves)`` takes one entry per NNX Variable (its value). A
    Variable whose value is a pytree, as an `Fp8State`'s `ScalingState` is, has several
    ``jax.tree.leaves``: Flax refuses those for any model (shown on a plain one). The
    leaves with ``is_leaf=`` a state (or the variables) are one per variable, and the
    merged FP8 model computes what the original does, bit for bit, under jit too."""
    class Plain(nnx.Module):
        def __init__(self):
            self.v = nnx.Variable({"a": jnp.ones(2), "b": jnp.zeros(3)})

    g, s = nnx.split(Plain())
    with pytest.raises(ValueError, match="expected 1 leaves, but got 2"):
        nnx.merge(g, jax.tree.leaves(s))                         # Flax's own rule

    model = _trained_net()
    assert float(model.l1.dot_general.input.get_value().scale) != 1.0
    want = model(X)
    graphdef, state = nnx.split(model)
    n_vars = len(jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    assert len(jax.tree.leaves(state)) > n_vars                 # 3 arrays per Fp8State
    with pytest.raises(ValueError, match="Incorrect number of leaves"):
        nnx.merge(graphdef, jax.tree.leaves(state))
    for leaves in (jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jax_fp8.ScalingState)),
                   jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))):
        assert len(leaves) == n_vars
        np.testing.assert_array_equal(nnx.merge(graphdef, leaves)(X), want)

        @jax.jit
        def forward(leaves, x):
            return nnx.merge(graphdef, leaves)(x)

        np.testing.assert_array_equal(forward(leaves, X), want)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(X), want)


# ------------------------------------------------------------------------- jax.export

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dg = functools.partial(Fp8DotGeneral, recipe=RECIPE)
        return nn.Dense(4, dot_general_cls=dg)(nn.relu(nn.Dense(16, dot_general_cls=dg)(x)))


def _export_round_trip(f, *args):
    exp = jax.export.export(f, disabled_checks=jax_fp8.export_disabled_checks())(*args)
    return jax.export.deserialize(exp.serialize())


def test_export_of_a_train_step_on_linen_packed_state():
    """A jitted step (params, packed FP8 state) -> (loss, params, packed FP8 state),
    exported, serialized, deserialized and called: the same numbers, bit for bit, and the
    packed collection comes back as one."""
    model = MLP()
    state = Fp8TrainState.create(apply_fn=model.apply, variables=model.init(jax.random.key(0), X),
                                 tx=optax.sgd(1e-2), recipe=RECIPE)
    assert isinstance(state.fp8, PackedCollection) and len(state.fp8.groups) == 2

    @jax.jit
    def step(params, fp8, x, y):
        st = state.replace(params=params, fp8=fp8)

        def loss_fn(params, fp8):
            return jnp.mean((st.apply_model(params, fp8, x) - y) ** 2)
        loss, grads = st.value_and_grad(loss_fn)()
        new = st.apply_gradients(grads=grads)
        return loss, new.params, new.fp8

    back = _export_round_trip(step, state.params, state.fp8, X, Y)
    params, fp8 = state.params, state.fp8
    for _ in range(2):                       # the second call: scales the first one set
        want = step(params, fp8, X, Y)
        got = back.call(params, fp8, X, Y)
        assert isinstance(got[2], PackedCollection)
        assert_trees_equal(got, want)
        _, params, fp8 = want
    assert not np.array_equal(np.asarray(fp8.groups[0].scale),
                              np.asarray(state.fp8.groups[0].scale))
    # An inference function of the (params, packed state) pair.
    apply = jax.jit(lambda p, fp8, x: model.apply({"params": p, "fp8_meta": fp8}, x))
    np.testing.assert_array_equal(_export_round_trip(apply, params, fp8, X).call(params, fp8, X),
                                  apply(params, fp8, X))


def test_export_of_packed_metas():
    """`PackedStates` of a list of Fp8Metas (a `PackedStates`, not a collection)."""
    w = rand(2, (8, 4))
    packed = jax_fp8.pack_states([jax_fp8.Fp8Meta.create(RECIPE), None,
                                  (jax_fp8.Fp8Meta.create(RECIPE),)])
    assert type(packed) is jax_fp8.PackedStates

    @jax.jit
    def f(packed, x, w):
        metas = packed.unpack()
        y, _ = jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), metas[0])
        z, _ = jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), metas[2][0])
        return y + z, packed

    back = _export_round_trip(f, packed, X, w)
    got = back.call(packed, X, w)
    assert type(got[1]) is jax_fp8.PackedStates
    assert_trees_equal(got, f(packed, X, w))


@pytest.mark.parametrize("tree, what", [
    ({0: jax_fp8.Fp8Meta.create(RECIPE)}, "a dict with a int key"),
    (flax_core.freeze({"a": jax_fp8.Fp8Meta.create(RECIPE)}), "FrozenDict node"),
])
def test_export_refuses_a_packed_tree_it_cannot_rebuild(tree, what):
    packed = jax_fp8.pack_states(tree)
    exp = jax.export.export(jax.jit(lambda p: p),
                            disabled_checks=jax_fp8.export_disabled_checks())(packed)
    with pytest.raises(ValueError, match=rf"cannot serialize this packed FP8 state.*{what}.*"
                                         r"jax_fp8\.unpack_states"):
        exp.serialize()


def test_export_refuses_fp8_gradients_naming_the_fix():
    """FP8 gradients (AmaxGrad, packed or not) are of an extended dtype jax.export does not
    serialize: a function returning them is refused at serialize(), naming the fix."""
    model = MLP()
    state = Fp8TrainState.create(apply_fn=model.apply, variables=model.init(jax.random.key(0), X),
                                 tx=optax.sgd(1e-2), recipe=RECIPE)

    @jax.jit
    def grads_of(params, fp8, x, y):
        st = state.replace(params=params, fp8=fp8)
        return st.value_and_grad(
            lambda p, f: jnp.mean((st.apply_model(p, f, x) - y) ** 2))()[1]

    exp = jax.export.export(grads_of, disabled_checks=jax_fp8.export_disabled_checks())(
        state.params, state.fp8, X, Y)
    with pytest.raises(ValueError, match=r"FP8 gradients \(AmaxGrad\).*update inside"):
        exp.serialize()
