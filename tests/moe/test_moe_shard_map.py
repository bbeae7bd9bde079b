"""MaxText's mixture-of-experts layer as MaxText writes it: its experts' kernels handed to a
``jax.shard_map`` as arguments (``RoutedMoE.sparse_matmul``), in linen and in MaxText's NNX
port. `fp8_model` follows each kernel into the ``shard_map`` body and converts the three
grouped GEMMs there, with the numbers of the same layer written without the ``shard_map``;
a recipe that keeps state, which cannot run inside a ``shard_map``, is refused at trace time
naming the rule that fixes it."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_fp8
import moe_models as mm
from jax_fp8.flax import Fp8Rule, fp8_model
from test_moe_conversion import _RAGGED, _executed, _fp8

E, D, F, TOP_K = 16, 64, 32, 2
CURRENT = Fp8Rule(recipe=jax_fp8.Float8CurrentScaling(), min_fp8_flops=0)


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


def _x():
    return jax.random.normal(jax.random.key(0), (2, 16, D))


def _no_conversion_warning(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_fp8.Fp8ConversionWarning)
        return fn(*args)


def _loss(model, variables, x):
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}
    return jnp.mean(model.apply({"params": params, **rest}, x) ** 2)


def test_linen_experts_in_a_shard_map_convert_as_without_it():
    """Every grouped GEMM (3 forward, 6 backward) in FP8 in the program lowered for CUDA,
    nothing reported, and the loss and gradients those of the block without the shard_map,
    bit for bit."""
    x = _x()
    sharded = fp8_model(mm.LinenShardMapMoeBlock(E, TOP_K, D, F, mesh=_mesh()), CURRENT)
    plain = fp8_model(mm.LinenMoeBlock(E, TOP_K, D, F), CURRENT)
    variables = _no_conversion_warning(jax.jit(sharded.init), jax.random.key(1), x)
    # the gradient w.r.t. x too: else the first projections' input gradients are dead code
    step = jax.jit(jax.value_and_grad(lambda v, x: _loss(sharded, v, x), argnums=(0, 1)))
    got = _no_conversion_warning(step, variables, x)
    want = jax.jit(jax.value_and_grad(lambda v, x: _loss(plain, v, x), argnums=(0, 1)))(
        variables, x)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    text = step.trace(variables, x).lower(lowering_platforms=("cuda",)).as_text()
    grouped = [p for p in _executed(text, _RAGGED) if _fp8(p)]
    assert len(grouped) == 9, grouped
    assert not [p for p in _executed(text, _RAGGED) if not _fp8(p)]


def test_nnx_experts_in_a_shard_map_convert_as_the_linen_block():
    """MaxText's NNX port: the same numbers as the linen block without the shard_map. (Converted
    without an example input: a stateless recipe makes its FP8 layers at the first call, here
    inside nnx.jit, since an eager first call of a shard_map runs op by op.)"""
    x = _x()
    model = mm.NnxShardMapMoeBlock(E, TOP_K, D, F, mesh=_mesh(), rngs=nnx.Rngs(0))
    params = {"gate": {"kernel": model.gate.kernel[...]},
              **{n: getattr(model, n)[...] for n in ("wi_0", "wi_1", "wo")}}
    fp8_model(model, CURRENT)
    got = _no_conversion_warning(nnx.jit(lambda m, x: m(x)), model, x)
    plain = fp8_model(mm.LinenMoeBlock(E, TOP_K, D, F), CURRENT)
    np.testing.assert_array_equal(got, jax.jit(plain.apply)({"params": params}, x))


def test_a_recipe_with_state_in_a_shard_map_is_refused_naming_the_fix():
    """DelayedScaling cannot run inside the shard_map: refused when the model is traced,
    and the rule the message gives (a stateless recipe for the block, delayed scaling for
    the router outside the shard_map) converts every GEMM."""
    x = _x()
    block = mm.LinenShardMapMoeBlock(E, TOP_K, D, F, mesh=_mesh())
    with pytest.raises(TypeError, match=r"inside a jax.shard_map.*Fp8Rule\(path='', "
                                        r"recipe=jax_fp8.Float8CurrentScaling\(\)\)"):
        jax.jit(fp8_model(block, Fp8Rule(min_fp8_flops=0)).init)(jax.random.key(1), x)
    model = fp8_model(block, [Fp8Rule(path="", recipe=jax_fp8.Float8CurrentScaling(),
                                      min_fp8_flops=0), Fp8Rule(min_fp8_flops=0)])
    variables = _no_conversion_warning(jax.jit(model.init), jax.random.key(1), x)
    assert list(variables["fp8_meta"]) == ["gate"]     # the router's delayed-scaling state
    loss, grads = jax.jit(jax.value_and_grad(lambda v, x: _loss(model, v, x)))(variables, x)
    assert np.isfinite(loss)
    assert grads["fp8_meta"]["gate"]["Fp8DotGeneral_0"]["input"].amax_history[0] > 0


class Helpers(nn.Module):
    """A weight passed into a jax.jit helper (twice: two weights) and a jax.checkpoint body."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (D, D))
        v = self.param("v", nn.initializers.lecun_normal(), (D, D))
        project = jax.jit(lambda a, b: a @ b.astype(a.dtype))
        h = project(x, w)
        h = project(h, v)     # the same jitted helper, another weight: traced anew
        return jax.checkpoint(lambda a, b: jnp.einsum("td,de->te", a, b))(h, w)


def _helpers_by_hand(params, x, recipe):
    meta = lambda: jax_fp8.Fp8Meta.create(recipe)  # noqa: E731
    dn = (((1,), (0,)), ((), ()))
    h = jax_fp8.fp8_dot_general(x, params["w"], dn, meta())[0]
    h = jax_fp8.fp8_dot_general(h, params["v"], dn, meta())[0]
    return jax_fp8.fp8_einsum("td,de->te", h, params["w"], meta())[0]


def test_a_weight_passed_into_a_jit_or_checkpoint_body_converts():
    """A weight passed as an argument into a jax.jit or jax.checkpoint body applied inside
    the module converts as the weight itself (each call traced with its own weight), with
    the numbers of the FP8 GEMMs written by hand."""
    x = jax.random.normal(jax.random.key(2), (8, D))
    recipe = jax_fp8.Float8CurrentScaling()
    model = fp8_model(Helpers(), Fp8Rule(recipe=recipe, min_fp8_flops=0))
    variables = _no_conversion_warning(jax.jit(model.init), jax.random.key(3), x)
    got = _no_conversion_warning(jax.jit(model.apply), variables, x)
    np.testing.assert_array_equal(got, _helpers_by_hand(variables["params"], x, recipe))


def test_a_recipe_with_state_in_a_jit_body_keeps_the_gemm_and_says_so():
    x = jax.random.normal(jax.random.key(2), (8, D))
    model = fp8_model(Helpers(), Fp8Rule(min_fp8_flops=0))
    variables = jax.jit(model.init)(jax.random.key(3), x)
    with pytest.warns(jax_fp8.Fp8ConversionWarning, match="inside a jax.jit or jax.checkpoint "
                      "body.*recipe=jax_fp8.Float8CurrentScaling"):
        got = jax.jit(model.apply)(variables, x)
    assert "fp8_meta" not in variables
    np.testing.assert_array_equal(got, jax.jit(Helpers().apply)(variables, x))
