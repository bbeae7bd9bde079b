"""Natural mistakes that name their fix: a model handed to the other framework's
`fp8_model`, `Fp8TrainState.create(params=...)` without the FP8 state, and a restore into
a changed model the way docs/getting_started.md restores (abstract target from
``jax.eval_shape``, `jax_fp8.flax.orbax_restore`)."""

from __future__ import annotations

import functools
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jax_fp8
import jax_fp8.equinox as jfe
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, orbax_restore

RECIPE = jax_fp8.DelayedScaling(history_len=4)


def _mlp(width, recipe=RECIPE):
    dense = functools.partial(nn.Dense,
                              dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return dense(4)(nn.gelu(dense(width)(x)))

    return MLP()


X = jnp.linspace(-1.0, 1.0, 4 * 8, dtype=jnp.float32).reshape(4, 8)


def _state(model, recipe=RECIPE):
    return Fp8TrainState.create(apply_fn=model.apply, variables=model.init(jax.random.key(0), X),
                                tx=optax.adam(1e-3), recipe=recipe)


# ------------------------------------------------------------ the other framework's converter

@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_equinox_fp8_model_refuses_a_flax_module_naming_the_flax_converter(kind):
    model = (_mlp(8) if kind == "linen" else nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"Flax .*module.*jax_fp8\.flax\.fp8_model\(model, rules\)"):
        jfe.fp8_model(model)


def test_flax_fp8_model_refuses_an_equinox_module_naming_the_equinox_converter():
    with pytest.raises(TypeError, match=r"Equinox module \(Linear\).*"
                                        r"jax_fp8\.equinox\.fp8_model\(model, rules\)"):
        jax_fp8.flax.fp8_model(eqx.nn.Linear(8, 4, key=jax.random.key(0)))
    with pytest.raises(TypeError, match=r"got dict .*jax_fp8\.equinox\.fp8_model"):
        jax_fp8.flax.fp8_model({"w": jnp.ones((2, 2))})


def test_equinox_fp8_model_warns_when_nothing_converts():
    """A model without an eqx.nn.Linear or a GEMM of a module's own weights comes back as it
    was, and says so; a model that converts (or is FP8 already) says nothing."""
    plain = {"w": jnp.ones((8, 4))}
    with pytest.warns(jax_fp8.Fp8ConversionWarning, match=r"nothing to convert in the dict"):
        assert jfe.fp8_model(plain) is not None
    linear = eqx.nn.Linear(8, 4, key=jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_fp8.Fp8ConversionWarning)
        fp8 = jfe.fp8_model(linear)
        assert isinstance(fp8, jfe.Fp8Linear)
        assert jfe.fp8_model(fp8) is fp8
        # excluded by its rule: a choice, not a mistake
        assert jfe.fp8_model(linear, jax_fp8.Fp8Rule(recipe=None)) is linear


# ----------------------------------------------------- Fp8TrainState.create without the FP8 state

def test_create_with_params_alone_names_the_fp8_collection():
    model = _mlp(8)
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"params= without fp8=.*fp8=variables\['fp8_meta'\]"):
        Fp8TrainState.create(apply_fn=model.apply, params=variables["params"],
                             tx=optax.adam(1e-3), recipe=RECIPE)
    with pytest.raises(ValueError, match=r"model.init's whole result: pass it as variables="):
        Fp8TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3),
                             recipe=RECIPE)
    # Given both, or a recipe that keeps no state, it is accepted.
    both = Fp8TrainState.create(apply_fn=model.apply, params=variables["params"],
                                fp8=variables["fp8_meta"], tx=optax.adam(1e-3), recipe=RECIPE)
    np.testing.assert_array_equal(both.apply_model(both.params, both.fp8, X),
                                  _state(model).apply_model(both.params, both.fp8, X))
    current = jax_fp8.Float8CurrentScaling()
    stateless = _mlp(8, current)
    Fp8TrainState.create(apply_fn=stateless.apply,
                         params=stateless.init(jax.random.key(0), X)["params"],
                         tx=optax.adam(1e-3), recipe=current)


def test_apply_model_refuses_fp8_states_made_on_the_fly():
    """fp8={} for a model with delayed-scaling layers: the layers would make fresh states at
    every call (evaluation on never-updated scales); the first apply says where they went."""
    model = _mlp(8)
    variables = model.init(jax.random.key(0), X)
    state = Fp8TrainState.create(apply_fn=model.apply, params=variables["params"], fp8={},
                                 tx=optax.adam(1e-3), recipe=RECIPE)
    with pytest.raises(ValueError, match=r"made 6 fresh FP8 states.*fp8=variables\['fp8_meta'\]"):
        state.apply_model(state.params, state.fp8, X)
    with pytest.raises(ValueError, match=r"made 6 fresh FP8 states"):
        jax.jit(lambda s: s.apply_model(s.params, s.fp8, X))(state)


# ------------------------------------------ a restore into a changed model, getting_started's way

def _save(tmp_path, state):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    return checkpointer


@pytest.mark.parametrize("change", ["width", "history"])
def test_restore_of_an_abstract_state_into_a_changed_model_names_the_fix(tmp_path, change):
    """docs/getting_started.md's restore (jax.eval_shape of the state's constructor, then
    orbax_restore) into a wider model, or the same model with another amax history
    length: a ValueError naming the variable and the fix, not orbax's tree dump or its
    padding suggestion; with fresh_fp8=True a recipe change keeps the params."""
    state = _state(_mlp(8))
    checkpointer = _save(tmp_path, state)
    recipe = RECIPE if change == "width" else RECIPE.replace(history_len=8)
    changed = _mlp(16 if change == "width" else 8, recipe)
    target = jax.eval_shape(lambda: _state(changed, recipe))
    if change == "width":
        expected = (r"params/Dense_0/kernel has shape \(8, 4\) in the checkpoint, "
                    r"the target's \(16, 4\)")
    else:
        expected = (r"packed FP8 group .*history 8\).*not in the checkpoint.*fresh_fp8=True"
                    r".*Never pad or truncate")
    with pytest.raises(ValueError, match=expected):
        orbax_restore(checkpointer, tmp_path / "ckpt", target)
    if change == "history":
        restored = orbax_restore(checkpointer, tmp_path / "ckpt", target, fresh_fp8=True)
        jax.tree.map(np.testing.assert_array_equal, restored.params, state.params)
        assert {length for *_, length in jax_fp8.state.states_info(restored.fp8)} == {8}
    same = orbax_restore(checkpointer, tmp_path / "ckpt", jax.eval_shape(lambda: state))
    np.testing.assert_array_equal(same.apply_model(same.params, same.fp8, X),
                                  state.apply_model(state.params, state.fp8, X))
