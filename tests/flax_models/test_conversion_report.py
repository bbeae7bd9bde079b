"""What fp8_model leaves out of FP8 is never silent: a module a rule matched that runs no
GEMM in FP8 is reported once as a jax_fp8.Fp8ConversionWarning naming the module, the rule
and why (a weight it cannot follow, below min_fp8_flops, a dtype the recipe does not take),
and jax_fp8.devtools.explain gives the same reason per GEMM. Also: the default rule converts
every GEMM (min_fp8_flops=0, as the hand-written layers), float64 models under x64, and
explain's row for an FP8 GEMM whose sizes are not multiples of 16."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_fp8
from jax_fp8.devtools import explain
from jax_fp8.flax import Fp8ConversionWarning, Fp8DotGeneral, Fp8Rule, fp8_model, nnx as fnnx
from jax_fp8.interception import KEPT_SCOPES


def record(fn, *args):
    """``fn(*args)`` and the Fp8ConversionWarnings it emitted (every one, not Python's
    once-per-location filter)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [w for w in caught if issubclass(w.category, Fp8ConversionWarning)]


def gemm_rows(f, *args):
    return [r for r in explain.explain(f, *args) if r.kind == "gemm"]


def test_the_warning_is_public_and_filterable():
    assert jax_fp8.Fp8ConversionWarning is Fp8ConversionWarning
    assert issubclass(Fp8ConversionWarning, UserWarning)


class Scaled(nn.Module):
    """A module whose GEMM multiplies its weight changed by arithmetic (not followed)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (32, 16))
        return jax.lax.dot_general(x, w * 2.0, (((1,), (0,)), ((), ())))


class Squeezed(nn.Module):
    """jnp.squeeze runs as a jit of its own: not followed (lax.squeeze is)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (32, 1, 16))
        return jnp.einsum("bd,dh->bh", x, jnp.squeeze(w, 1))


@pytest.mark.parametrize("module", [Scaled, Squeezed])
def test_linen_weight_not_followed_warns_once_and_explain_says_why(module):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return module(name="proj")(nn.Dense(16, name="dense")(x).repeat(2, axis=1))

    model = fp8_model(Model())
    x = jnp.ones((16, 32))
    variables, caught = record(model.init, jax.random.key(0), x)
    assert not caught                                  # init reports nothing
    assert list(variables["fp8_meta"]) == ["dense"]    # no state for what is not FP8
    for call in range(2):
        _, caught = record(model.apply, variables, x)
        if call == 0:
            assert len(caught) == 1, [str(w.message) for w in caught]
            message = str(caught[0].message)
            for part in ("'proj'", module.__name__, "Fp8Rule(path='.*'", "neither operand",
                         "'w'", "activations=True"):
                assert part in message, message
        else:
            assert not caught                          # once
    rows = gemm_rows(model.apply, variables, x)
    assert [r.lowering for r in rows] == ["fp8", "float32"]
    assert rows[1].why == KEPT_SCOPES["fp8_model_no_weight"]
    assert rows[1].where.startswith("Model/proj")
    with warnings.catch_warnings():                    # a filter silences it
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", Fp8ConversionWarning)
        fp8_model(Model()).apply(variables, x)


def test_an_unfollowed_weight_runs_as_the_unconverted_model():
    model, plain = fp8_model(Scaled()), Scaled()
    x = jax.random.normal(jax.random.key(0), (16, 32))
    variables = plain.init(jax.random.key(1), x)
    out, _ = record(model.apply, variables, x)
    np.testing.assert_array_equal(out, plain.apply(variables, x))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="down")(nn.relu(nn.Dense(64, name="up")(x)))


def test_linen_below_min_fp8_flops_warns_and_keeps_the_state():
    """min_fp8_flops="auto": every GEMM of this small model is kept in float32; each layer
    is reported, and keeps its FP8 state (the variables do not depend on the batch)."""
    model = fp8_model(Mlp(), Fp8Rule(min_fp8_flops="auto"))
    x = jnp.ones((16, 32))
    variables, caught = record(model.init, jax.random.key(0), x)
    assert not caught and sorted(variables["fp8_meta"]) == ["down", "up"]
    _, caught = record(model.apply, variables, x)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2 and "'down'" in messages[0] and "'up'" in messages[1]
    assert all("below the rule's min_fp8_flops (68719476736)" in m for m in messages)
    assert "dot_general of 65536 FLOPs" in messages[1], messages   # 2 * 16 * 32 * 64
    rows = gemm_rows(model.apply, variables, x)
    assert [r.lowering for r in rows] == ["float32"] * 2
    assert all("min_fp8_flops" in r.why for r in rows)


def test_the_default_rule_converts_every_gemm_on_the_cpu():
    """Fp8Rule()'s min_fp8_flops="measured" converts every GEMM of a model traced on the CPU
    (FP8 is emulated there: jax_fp8.fp8_pays), as min_fp8_flops=0 does everywhere."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU's decision (a GPU decides from its measured table)")
    assert Fp8Rule().min_fp8_flops == "measured"
    model = fp8_model(Mlp())
    x = jnp.ones((16, 32))
    variables = model.init(jax.random.key(0), x)
    _, caught = record(model.apply, variables, x)
    assert not caught
    assert [r.lowering for r in gemm_rows(model.apply, variables, x)] == ["fp8", "fp8"]


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def test_nnx_below_min_fp8_flops_warns_once():
    model = fp8_model(NnxMlp(nnx.Rngs(0)), Fp8Rule(min_fp8_flops=1e12))
    x = jnp.ones((16, 32))
    _, caught = record(model, x)
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2, messages
    assert "'down' (Linear)" in messages[0] and "'up' (Linear)" in messages[1]
    assert all("min_fp8_flops" in m for m in messages)
    _, caught = record(nnx.jit(lambda m, x: m(x)), model, x)
    assert not caught                                  # once per model


class NnxScaled(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (32, 16)))

    def __call__(self, x):
        return jnp.einsum("bd,dh->bh", x, self.w[...] * 2.0)


def test_nnx_weight_not_followed_warns_once():
    x = jnp.ones((16, 32))
    model, caught = record(fp8_model, NnxScaled(nnx.Rngs(0)), None, x)
    assert len(caught) == 1 and "root module (NnxScaled)" in str(caught[0].message)
    assert not hasattr(model, "w_fp8")                 # no state for what is not FP8
    _, caught = record(model, x)
    assert not caught
    rows = gemm_rows(nnx.jit(lambda m, x: m(x)), model, x)
    assert [r.why for r in rows] == [KEPT_SCOPES["fp8_model_no_weight"]]


def test_nnx_followed_weight_does_not_warn():
    class Proj(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (32, 16)))

        def __call__(self, x):
            w = jnp.asarray(self.w[...], jnp.bfloat16).reshape(32, 1, 16)
            return jax.lax.dot_general(x.astype(jnp.bfloat16), w.reshape(32, 16),
                                       (((1,), (0,)), ((), ())))

    x = jnp.ones((16, 32))
    model, caught = record(fp8_model, Proj(nnx.Rngs(0)), None, x)
    assert not caught and isinstance(model.w_fp8, fnnx.Fp8DotGeneral)
    rows = gemm_rows(nnx.jit(lambda m, x: m(x)), model, x)
    assert [r.lowering for r in rows] == ["fp8"]


# ------------------------------------------------------------------ float64 under x64

class Dense64(nn.Module):
    fp8: bool = False

    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, dtype=jnp.float64, param_dtype=jnp.float64,
                        dot_general_cls=Fp8DotGeneral if self.fp8 else None)(x)


def test_float64_delayed_scaling_converts_as_the_hand_written_layer():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (16, 32), jnp.float64)
        hand = Dense64(fp8=True)
        variables = hand.init(jax.random.key(1), x)
        converted = fp8_model(Dense64())
        assert jax.tree.structure(converted.init(jax.random.key(1), x)) == \
            jax.tree.structure(variables)
        out, caught = record(converted.apply, variables, x)
        assert not caught and out.dtype == jnp.float64
        np.testing.assert_array_equal(out, hand.apply(variables, x))


@pytest.mark.parametrize("recipe", [jax_fp8.Float8CurrentScaling(),
                                    jax_fp8.Float8BlockScaling()])
def test_float64_other_recipes_warn_naming_the_dtype(recipe):
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (16, 32), jnp.float64)
        with pytest.raises(TypeError, match="float64"):   # the hand-written layer
            nn.Dense(16, dtype=jnp.float64, param_dtype=jnp.float64,
                     dot_general_cls=lambda: Fp8DotGeneral(recipe=recipe)).init(
                         jax.random.key(1), x)
        converted, plain = fp8_model(Dense64(), Fp8Rule(recipe=recipe)), Dense64()
        variables = plain.init(jax.random.key(1), x)
        out, caught = record(converted.apply, variables, x)
        assert len(caught) == 1 and "float64" in str(caught[0].message)
        assert type(recipe).__name__ in str(caught[0].message)
        np.testing.assert_array_equal(out, plain.apply(variables, x))
        rows = gemm_rows(converted.apply, variables, x)
        assert [(r.lowering, r.why) for r in rows] == [("float64",
                                                        KEPT_SCOPES["fp8_model_dtype"])]


# ------------------------------------------------- explain: sizes not multiples of 16

def test_explain_names_fp8_operands_widened_for_sizes_not_multiples_of_16():
    """Batch 4 and 24 features: the layer quantizes its operands, and the GEMM of those FP8
    values runs widened to float32 (no FP8 GEMM takes those sizes)."""
    model = fp8_model(nn.Dense(24))
    x = jnp.ones((4, 24))
    variables = model.init(jax.random.key(0), x)
    rows = gemm_rows(model.apply, variables, x)
    assert [r.lowering for r in rows] == ["fp8 operands in float32"]
    assert "not a multiple of 16" in rows[0].why and rows[0].where == "Dense/Fp8DotGeneral_0"
