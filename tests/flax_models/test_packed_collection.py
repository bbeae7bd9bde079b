"""An Fp8TrainState's packed FP8 collection given to Flax's apply where the collection
goes: ``model.apply({"params": state.params, "fp8_meta": state.fp8}, x)``.

A PackedStates of a Flax collection is a `jax_fp8.packing.PackedCollection`: a read-only
mapping of the unpacked collection for Flax, the packed groups for every pytree function.
The model then computes what ``state.apply_model`` computes, bit for bit, in the same
program (one split per packed scale vector), and a gradient with respect to it is packed
like it and updates the state as ``apply_gradients`` does.
"""

import copy
import functools
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import jax_fp8
from helpers import assert_trees_equal, rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState
from jax_fp8.packing import PackedCollection

RECIPE = jax_fp8.DelayedScaling(history_len=4)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
SPLIT = "@jax_fp8_split_rows"
X = rand(0, (8, 16), 2.0)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(16, dot_general_cls=DG)(h)), None


class Model(nn.Module):
    """Dense, three scanned layers (stacked states), one Dense called twice."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dot_general_cls=DG)(x)
        x = nn.scan(Block, variable_axes={"params": 0, FP8_COLLECTION: 0},
                    split_rngs={"params": True}, length=3)(name="stack")(x, None)[0]
        twice = nn.Dense(16, dot_general_cls=DG)
        return twice(twice(x))


def _loss_of(apply):
    return lambda params, fp8: jnp.sum(jnp.sin(apply(params, fp8)))


@pytest.fixture(scope="module")
def state():
    """A state one step in (its scales no longer 1)."""
    model = Model()
    v = jax.jit(model.init)(jax.random.key(0), X)
    st = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.sgd(1e-2),
                              recipe=RECIPE)
    loss = _loss_of(lambda p, f: st.apply_model(p, f, X))
    return jax.jit(lambda s: s.apply_gradients(grads=s.value_and_grad(loss)()[1]))(st)


def _apply(params, fp8, mutable=False):
    out = Model().apply({"params": params, FP8_COLLECTION: fp8}, X, mutable=mutable)
    return out[0] if mutable else out


def test_model_apply_takes_the_packed_collection(state):
    assert isinstance(state.fp8, PackedCollection)
    want = state.apply_model(state.params, state.fp8, X)
    assert np.any(np.asarray(jax.tree.leaves(state.fp8.groups)[1]) != 1)   # trained scales
    np.testing.assert_array_equal(_apply(state.params, state.fp8), want)
    np.testing.assert_array_equal(jax.jit(_apply)(state.params, state.fp8), want)
    np.testing.assert_array_equal(
        jax.jit(functools.partial(_apply, mutable=(FP8_COLLECTION,)))(state.params, state.fp8),
        want)
    np.testing.assert_array_equal(Model().apply(state.variables(), X), want)
    # Closed over by jit: the same numbers as the unpacked collection closed over.
    unpacked = state.fp8.unpack()
    np.testing.assert_array_equal(jax.jit(lambda p: _apply(p, state.fp8))(state.params),
                                  jax.jit(lambda p: _apply(p, unpacked))(state.params))


def test_the_same_program_as_apply_model(state):
    def body(f):  # the lowered module without its first line (which names the function)
        return f.lower(state.params, state.fp8).as_text().split("\n", 1)[1]

    ours, theirs = body(jax.jit(_apply)), body(jax.jit(lambda p, f: state.apply_model(p, f, X)))
    assert ours.count(SPLIT) == 4   # scale and scale_inv of 2 groups
    assert ours == theirs


@pytest.mark.parametrize("mutable", [False, (FP8_COLLECTION,)], ids=["read_only", "mutable"])
def test_gradient_through_model_apply_is_packed_and_updates_the_state(state, mutable):
    loss = _loss_of(functools.partial(_apply, mutable=mutable))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(state.params, state.fp8)
    assert isinstance(grads[1], PackedCollection)
    _, want = jax.jit(lambda s: s.value_and_grad(
        _loss_of(lambda p, f: s.apply_model(p, f, X)))())(state)
    # The raw cotangent and the FP8 gradients of value_and_grad (AmaxGrads): the same amaxes.
    assert_trees_equal(jax_fp8.amax_cotangents(grads[1]),
                       jax_fp8.amax_cotangents(want[FP8_COLLECTION]))
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(
        state, {"params": grads[0], FP8_COLLECTION: grads[1]})
    assert_trees_equal(new.fp8, jax_fp8.new_fp8_state(state.fp8, want[FP8_COLLECTION], RECIPE))


def test_mapping_and_pytree_views(state):
    fp8, unpacked = state.fp8, state.fp8.unpack()
    assert list(fp8) == list(fp8.keys()) == sorted(unpacked) and len(fp8) == len(unpacked)
    assert "stack" in fp8 and "nothing" not in fp8
    assert_trees_equal(dict(fp8), unpacked)
    assert_trees_equal(fp8["stack"], unpacked["stack"])
    assert fp8 != {} and {} != fp8 and fp8 != unpacked               # not dict equality
    with pytest.raises(TypeError, match=r"read-only.*unpack_states"):
        fp8["Dense_0"] = unpacked["Dense_0"]
    with pytest.raises(TypeError, match="read-only"):
        fp8.update(unpacked)
    # Pytree functions, copies, pickles and checkpoints see the packed groups.
    assert len(jax.tree.leaves(fp8)) == 6
    for same in (copy.copy(fp8), copy.deepcopy(fp8), pickle.loads(pickle.dumps(fp8)),
                 serialization.from_bytes(fp8, serialization.to_bytes(fp8)),
                 jax.tree.map(lambda a: a, fp8)):
        assert type(same) is PackedCollection
        assert_trees_equal(same, fp8)
    # A packed tree that is not a collection is no mapping.
    metas = [jax_fp8.Fp8Meta.create(RECIPE), jax_fp8.Fp8Meta.create(RECIPE)]
    packed = jax_fp8.pack_states(metas)
    assert type(packed) is jax_fp8.PackedStates and not isinstance(packed, dict)
