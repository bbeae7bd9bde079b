"""Each error a first loop runs into names the fix, and following the fix works."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState, nnx as fnnx

pytestmark = pytest.mark.usefixtures("on_cpu")


X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))


@pytest.mark.parametrize("cls", [jax_fp8.DelayedScaling, jax_fp8.Float8CurrentScaling,
                                 jax_fp8.Float8BlockScaling])
def test_a_recipe_class_names_the_instance_to_pass(cls):
    want = rf"got the class {cls.__name__}: pass `{cls.__name__}\(\)`, an instance"
    with pytest.raises(TypeError, match=want):
        jax_fp8.Fp8Meta.create(cls)
    with pytest.raises(TypeError, match=want):
        fnnx.Fp8Linear(8, 4, recipe=cls, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=want):
        nn.Dense(4, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=cls)).init(
            jax.random.key(0), X)
    jax_fp8.Fp8Meta.create(cls())   # the fix


def test_a_history_length_mismatch_names_recipe_for_create_and_apply_gradients():
    recipe = jax_fp8.DelayedScaling(history_len=16)
    model = nn.Dense(4, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe))
    variables = model.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=r"the default, taken when no recipe is passed\): "
                                         r"it has history length 16, the recipe's is 1024.*"
                                         r"pass `recipe=` to `Fp8TrainState.create.*"
                                         r"apply_gradients"):
        Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1))
    Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1),
                         recipe=recipe)   # the fix


def test_check_fp8_updated_nnx_fix_has_the_recipe_and_works_as_written():
    recipe = jax_fp8.DelayedScaling(history_len=16)
    model = fnnx.Fp8Linear(8, 4, recipe=recipe, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"apply_gradients\(model, optimizer, grads, "
                                         r"recipe\)`.*Fp8Optimizer\(model, tx, "
                                         r"wrt=nnx.Param, recipe=recipe\)") as err:
        fnnx.check_fp8_updated(model)
    assert "the one the layers were made with" in str(err.value)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    loss_fn = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    _, grads = fnnx.fp8_value_and_grad(loss_fn)(model, X)
    with pytest.raises(ValueError, match=r"pass `recipe=`"):  # the recipe left out
        fnnx.apply_gradients(model, optimizer, grads)
    fnnx.apply_gradients(model, optimizer, grads, recipe)     # the fix, as written
    fnnx.check_fp8_updated(model)
