"""FP8 state saves and restores with orbax (linen TrainState, bare Fp8Meta trees, NNX)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import helpers
import jax_fp8
from helpers import rand
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, nnx as fnnx
from nnx_mlp import Fp8Mlp

RECIPE = jax_fp8.DelayedScaling(history_len=8)
IS_STATE = lambda x: isinstance(x, jax_fp8.ScalingState)  # noqa: E731


def _save_restore(path, tree, target):
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, tree)
    ckptr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    return ckptr.restore(path, abstract)


def _assert_same_states(a, b):
    sa, sb = (jax.tree.leaves(t, is_leaf=IS_STATE) for t in (a, b))
    assert len(sa) == len(sb) and all(IS_STATE(s) for s in sa + sb)
    for x, y in zip(sa, sb):
        assert x.fp8_dtype == y.fp8_dtype
        for f in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        dg = functools.partial(Fp8DotGeneral, recipe=RECIPE)
        x = nn.relu(nn.Dense(16, dot_general_cls=dg)(x))
        return nn.Dense(4, dot_general_cls=dg)(x)


_step = jax.jit(helpers.mse_fp8_step)


@pytest.mark.parametrize("pack", [False, True], ids=["per_tensor", "packed"])
def test_linen_train_state_checkpoint_and_resume(tmp_path, pack):
    x, y = rand(0, (16, 8), 4.0), rand(1, (16, 4))
    model = MLP()
    v = jax.jit(model.init)(jax.random.key(0), x)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.adam(1e-2),
                                 recipe=RECIPE, pack_fp8=pack)
    for _ in range(3):
        state, _ = _step(state, x, y)
    fresh = Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=optax.adam(1e-2),
                                 recipe=RECIPE, pack_fp8=pack)
    restored = _save_restore(tmp_path / "ckpt", state, fresh)
    assert jax.tree.structure(restored.fp8) == jax.tree.structure(state.fp8)
    _assert_same_states(restored.fp8, state.fp8)
    assert int(restored.step) == 3
    # Histories were non-trivial (three steps recorded), so this is a real check.
    h = jax_fp8.unpack_states(state.fp8)["Dense_0"]["Fp8DotGeneral_0"]["input"].amax_history
    assert int(jnp.sum(h > 0)) == 3
    # Training resumes identically from the restored state.
    a, la = _step(state, x, y)
    b, lb = _step(restored, x, y)
    assert float(la) == float(lb)
    _assert_same_states(a.fp8, b.fp8)


def test_bare_fp8_meta_tree_checkpoint(tmp_path):
    tree = {"layers": jax_fp8.Fp8Meta.create(RECIPE, shape=(3,)),
            "head": jax_fp8.Fp8Meta.create(RECIPE)}
    tree = jax.tree.map(lambda a: a + jnp.abs(rand(a.size, a.shape)), tree)
    restored = _save_restore(tmp_path / "meta", tree, tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    _assert_same_states(restored, tree)


def test_nnx_fp8_state_checkpoint(tmp_path):
    x = rand(0, (8, 8), 3.0)
    net = Fp8Mlp(nnx.Rngs(0), recipe=RECIPE, sizes=(8, 8, 4))

    @nnx.jit
    def step(net):
        _, fg = fnnx.fp8_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(net)
        fnnx.update_fp8(net, fg, RECIPE)

    step(net)
    step(net)
    state = nnx.state(net)
    other = Fp8Mlp(nnx.Rngs(1), recipe=RECIPE, sizes=(8, 8, 4))
    restored = _save_restore(tmp_path / "nnx", state, nnx.state(other))
    nnx.update(other, restored)
    _assert_same_states(fnnx.fp8_state(other), fnnx.fp8_state(net))
    np.testing.assert_array_equal(other.l1.kernel[...], net.l1.kernel[...])
    st = fnnx.fp8_state(other)["l1"]["dot_general"]["input"]
    st = st.get_value() if hasattr(st, "get_value") else st.value
    assert float(st.scale) != 1.0 and float(st.amax_history[-1]) == float(jax_fp8.compute_amax(x))
