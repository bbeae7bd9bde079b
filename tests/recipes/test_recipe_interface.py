"""The `Recipe` interface asked for every fact about a recipe: how it serializes (the
stored form of a meta's recipe unchanged), the states it keeps, and the messages that list
the registered recipes, with a test-only recipe registered beside the four."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
import moe_models as mm
from helpers import rand
from jax_fp8 import meta as meta_lib, recipe as recipe_lib
from jax_fp8.flax import Fp8Rule, fp8_model
from jax_fp8.gemm.scaled_dot import StatelessRecipe, scaled_dot_general

DN = (((1,), (0,)), ((), ()))

# The stored form of each meta's recipe (jax.export's Fp8Meta aux data, and the packed-state
# layout that embeds it): written before the recipes serialized themselves, it must still
# be written, and read back, byte for byte.
STORED = [
    (None, b'null'),
    (jax_fp8.Float8BlockScaling(),
     b'{"recipe": "Float8BlockScaling", "fp8_format": "E4M3", "power_of_2_scale": true, '
     b'"amax_epsilon": 0.0, "x_block_scaling_dim": 1, "w_block_scaling_dim": 2, '
     b'"grad_block_scaling_dim": 1}'),
    (jax_fp8.Float8BlockScaling(fp8_format=jax_fp8.Format.HYBRID, power_of_2_scale=False,
                                amax_epsilon=1e-6, w_block_scaling_dim=1),
     b'{"recipe": "Float8BlockScaling", "fp8_format": "HYBRID", "power_of_2_scale": false, '
     b'"amax_epsilon": 1e-06, "x_block_scaling_dim": 1, "w_block_scaling_dim": 1, '
     b'"grad_block_scaling_dim": 1}'),
    (jax_fp8.Float8CurrentScaling(),
     b'{"recipe": "Float8CurrentScaling", "fp8_format": "HYBRID", "power_of_2_scale": false, '
     b'"amax_epsilon": 0.0}'),
    (jax_fp8.MXFP8BlockScaling(), b'{"recipe": "MXFP8BlockScaling", "fp8_format": "E4M3"}'),
    (jax_fp8.DelayedScaling(history_len=16, margin=1.0),
     b'{"recipe": "DelayedScaling", "history_len": 16, "amax_compute_algo": "max", '
     b'"margin": 1.0, "fp8_format": "HYBRID", "power_of_2_scale": false, '
     b'"skip_unused": false}'),
]


@pytest.mark.parametrize("recipe, stored", STORED,
                         ids=[type(r).__name__ if r else "states" for r, _ in STORED])
def test_a_meta_recipe_serializes_as_it_was_stored(recipe, stored):
    assert meta_lib._serialize_aux((recipe,)) == stored
    (back,) = meta_lib._deserialize_aux(stored)
    assert back == recipe and type(back) is type(recipe)
    if recipe is not None:
        assert type(back.fp8_format) is jax_fp8.Format


# ------------------------------------------- a fifth recipe, registered by the tests only

@dataclasses.dataclass(frozen=True)
class RoundedScaling(StatelessRecipe):
    """Test-only recipe without state: each operand rounded to ``dtype`` (a saturating
    cast, scale 1), one float32 GEMM, a straight-through backward. ``dtype`` is a NumPy
    dtype, which JSON cannot hold: it serializes by name."""

    keeps_state: ClassVar[bool] = False
    auto_min_fp8_flops: ClassVar[float] = 0.0

    dtype: np.dtype = np.dtype(jnp.float8_e4m3fn)

    def to_fields(self) -> dict[str, Any]:
        return {"dtype": self.dtype.name}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> RoundedScaling:
        return cls(dtype=np.dtype(getattr(jnp, fields["dtype"])))

    def _rounded(self, a: jax.Array) -> jax.Array:
        limit = float(jnp.finfo(self.dtype).max)
        return jnp.clip(a, -limit, limit).astype(self.dtype).astype(jnp.float32)

    def matmul_forward(self, x: jax.Array, w: jax.Array, out_dtype: np.dtype,
                       keep: bool) -> tuple[jax.Array, Any]:
        out = jnp.dot(self._rounded(x), self._rounded(w), preferred_element_type=jnp.float32)
        return out.astype(out_dtype), ((x, w) if keep else None)

    def matmul_backward(self, residuals: Any, g: jax.Array, x_dtype: np.dtype,
                        w_dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
        x, w = residuals
        return (jnp.dot(g, w.T).astype(x_dtype), jnp.dot(x.T, g).astype(w_dtype))


@pytest.fixture
def fifth():
    """RoundedScaling registered for one test, the registry as it was afterwards."""
    before = dict(recipe_lib._REGISTRY)
    recipe_lib.register(RoundedScaling)
    yield RoundedScaling
    recipe_lib._REGISTRY.clear()
    recipe_lib._REGISTRY.update(before)


E5M2 = RoundedScaling(dtype=np.dtype(jnp.float8_e5m2))
X, W = rand(0, (16, 32)), rand(1, (32, 8))


def test_a_recipe_serializes_as_it_says(fifth):
    stored = b'{"recipe": "RoundedScaling", "dtype": "float8_e5m2"}'
    assert meta_lib._serialize_aux((E5M2,)) == stored
    (back,) = meta_lib._deserialize_aux(stored)
    assert type(back) is RoundedScaling and back == E5M2 and back.dtype == E5M2.dtype


def test_a_registered_recipe_round_trips_through_export(fifth):
    meta = jax_fp8.Fp8Meta.create(E5M2)
    f = jax.jit(lambda x, w, m: jax_fp8.fp8_dot_general(x, w, DN, m))
    exp = jax.export.export(f, disabled_checks=jax_fp8.export_disabled_checks())(X, W, meta)
    out, back = jax.export.deserialize(exp.serialize()).call(X, W, meta)
    assert back == meta
    want = jnp.dot(E5M2._rounded(X), E5M2._rounded(W), preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out, f(X, W, meta)[0])


def test_a_registered_recipe_round_trips_through_a_packed_layout(fifth):
    """A packed tree of a meta of states and one of the fifth recipe: its layout (which
    stores each meta's recipe) serialized and read back gives the same tree."""
    tree = [jax_fp8.Fp8Meta.create(jax_fp8.DelayedScaling(history_len=4)),
            jax_fp8.Fp8Meta.create(E5M2)]
    packed = jax_fp8.pack_states(tree)
    exp = jax.export.export(jax.jit(lambda p: p),
                            disabled_checks=jax_fp8.export_disabled_checks())(packed)
    back = jax.export.deserialize(exp.serialize()).call(packed)
    assert jax.tree.structure(back) == jax.tree.structure(packed)
    unpacked = jax_fp8.unpack_states(back)
    assert unpacked[1] == tree[1] and unpacked[0].recipe is None
    jax.tree.map(np.testing.assert_array_equal, unpacked[0], tree[0])


def test_without_state_offers_the_stand_in_first_and_every_registered_one(fifth):
    delayed = jax_fp8.DelayedScaling()
    assert recipe_lib.without_state(delayed) == (
        "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "RoundedScaling")
    assert recipe_lib.without_state() == recipe_lib.without_state(delayed)
    assert recipe_lib.without_state(E5M2) == (
        "Float8BlockScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "RoundedScaling")


def test_every_stand_in_is_a_registered_recipe_without_state():
    for cls in recipe_lib.registered():
        if cls.keeps_state:
            assert not recipe_lib.by_name(cls.stand_in).keeps_state
        else:
            assert cls.stand_in is None


def test_messages_list_a_registered_recipe(fifth):
    listed = "Float8BlockScaling, MXFP8BlockScaling or RoundedScaling"
    with pytest.raises(TypeError, match=re.escape(
            f"recipe must be a recipe that keeps no state (jax_fp8.Float8CurrentScaling, "
            f"{listed}), got DelayedScaling")):
        scaled_dot_general(X, W, DN, jax_fp8.DelayedScaling())
    with pytest.raises(TypeError, match=re.escape(
            "recipe must be a jax_fp8.Float8BlockScaling, Float8CurrentScaling, "
            "DelayedScaling, MXFP8BlockScaling or RoundedScaling instance")):
        jax_fp8.Fp8Meta.create(object())


def test_the_shard_map_refusal_lists_a_registered_recipe(fifth):
    block = mm.LinenShardMapMoeBlock(16, 2, 64, 32, mesh=jax.sharding.Mesh(
        np.array(jax.devices()[:1]), ("data",)))
    x = jax.random.normal(jax.random.key(0), (2, 16, 64))
    with pytest.raises(TypeError, match=re.escape(
            "recipe=jax_fp8.Float8CurrentScaling()) (or Float8BlockScaling / MXFP8BlockScaling "
            "/ RoundedScaling) before the other rules")):
        jax.jit(fp8_model(block, Fp8Rule(min_fp8_flops=0)).init)(jax.random.key(1), x)


def test_the_equinox_activation_refusal_lists_a_registered_recipe(fifth):
    jfe = pytest.importorskip("jax_fp8.equinox")

    class Scores(eqx.Module):
        def __call__(self, q, k):
            return jnp.einsum("qd,kd->qk", q, k)

    with pytest.raises(ValueError, match=re.escape(
            "Fp8Rule(activations=True) with DelayedScaling (a recipe that keeps state) "
            "matches Scores at")) as caught:
        jfe.fp8_model(Scores(), Fp8Rule(activations=True, min_fp8_flops=0))
    assert ("Use Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling() or "
            "RoundedScaling() for that rule (they keep no state)") in str(caught.value)


# ------------------------------------------------------------------- the states it keeps

def test_a_recipe_creates_its_states_of_its_dtypes_and_history():
    recipe = jax_fp8.DelayedScaling(history_len=8, fp8_format=jax_fp8.Format.HYBRID)
    assert recipe.state_history_len() == 8
    meta = recipe.create_meta((3,))
    for role, dtype in recipe.state_dtypes().items():
        state = recipe.create_state(role, (3,))
        assert state.fp8_dtype == dtype and state.amax_history.shape == (3, 8)
        jax.tree.map(np.testing.assert_array_equal, state, getattr(meta, role))
    assert recipe.create_state("grad", history_len=2).amax_history.shape == (2,)
    assert recipe.create_state("grad").fp8_dtype == np.dtype(jnp.float8_e5m2)
    with pytest.raises(ValueError, match="keeps no 'bias' state"):
        recipe.create_state("bias")


@pytest.mark.parametrize("recipe", [jax_fp8.Float8CurrentScaling(), jax_fp8.MXFP8BlockScaling()])
def test_a_recipe_without_state_creates_none(recipe):
    assert recipe.state_history_len() is None and recipe.state_dtypes() == {}
    with pytest.raises(TypeError, match="keeps no state"):
        recipe.create_state("input")
