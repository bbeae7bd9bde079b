"""Checkpoints of Equinox FP8 models: eqx.tree_serialise_leaves (through jax_fp8.equinox's
header) and orbax round-trip bit for bit; a changed model is refused, naming the variable."""

import os

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jax_fp8
import jax_fp8.equinox as jfe
from jax_fp8 import Fp8Rule

MLP = eqx.nn.MLP(16, 16, 32, 1, key=jr.key(0))


def _model(history_len=4, fp8_format=jax_fp8.Format.HYBRID, width=32):
    mlp = MLP if width == 32 else eqx.nn.MLP(16, 16, width, 1, key=jr.key(0))
    recipe = jax_fp8.DelayedScaling(history_len=history_len, fp8_format=fp8_format)
    return jfe.fp8_model(mlp, Fp8Rule(recipe=recipe, min_fp8_flops=0))


def _trained():
    """A model whose FP8 states are not the fresh ones (one update)."""
    model = _model()
    x = jr.normal(jr.key(1), (4, 16))
    grads = eqx.filter_grad(lambda m: jax.numpy.sum(jax.vmap(m)(x) ** 2))(model)
    updates = jax.tree.map(jax.numpy.zeros_like, jfe.params(model))
    return jfe.apply_updates(model, updates, grads)


def _assert_same(a, b):
    la, lb = (jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (a, b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


CHANGED = [
    (dict(history_len=8), r"\.layers\[0\]\.fp8\.meta\.input\.amax_history_float8_e4m3fn has shape"),
    (dict(fp8_format=jax_fp8.Format.E4M3), r"no variable .*grad\.amax_history_float8_e4m3fn"),
    (dict(width=48), r"\.layers\[0\]\.weight has shape"),
]


def test_serialise_leaves_round_trip_and_a_changed_model_is_refused(tmp_path):
    model = _trained()
    path = os.path.join(tmp_path, "model.eqx")
    jfe.tree_serialise_leaves(path, model)
    _assert_same(jfe.tree_deserialise_leaves(path, _model()), model)
    for changes, match in CHANGED:
        with pytest.raises(ValueError, match=match):
            jfe.tree_deserialise_leaves(path, _model(**changes))
    plain = os.path.join(tmp_path, "plain.eqx")
    eqx.tree_serialise_leaves(plain, model)              # Equinox's own format still loads
    _assert_same(eqx.tree_deserialise_leaves(plain, _model()), model)
    with pytest.raises(ValueError, match="not a jax_fp8.equinox checkpoint"):
        jfe.tree_deserialise_leaves(plain, _model())


def test_orbax_round_trip_and_a_changed_model_is_refused(tmp_path):
    model = _trained()
    checkpointer = ocp.StandardCheckpointer()
    directory = os.path.join(tmp_path, "step_1")
    checkpointer.save(directory, eqx.filter(model, eqx.is_array))
    checkpointer.wait_until_finished()
    _assert_same(jfe.orbax_restore(checkpointer, directory, _model()), model)
    for changes, match in CHANGED:
        with pytest.raises(ValueError, match=match.replace(r"\.layers\[0\]\.", r"layers\.0\.")):
            jfe.orbax_restore(checkpointer, directory, _model(**changes))
    # Orbax alone refuses a format change by the arrays' names too.
    dynamic, _ = eqx.partition(_model(fp8_format=jax_fp8.Format.E4M3), eqx.is_array)
    with pytest.raises(ValueError, match="amax_history_float8_e4m3fn"):
        checkpointer.restore(directory, dynamic)
