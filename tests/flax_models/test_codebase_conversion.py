"""fp8_model on projections written as T5X and MaxText write them (codebase_layers.py): the
weight is a parameter cast to the computation dtype, reshaped to N-d, sharding-constrained
(``param_with_axes``, ``nn.with_logical_partitioning``) and multiplied by an N-d
``lax.dot_general``. Converted, each projection is that weight's FP8 GEMM: with every
recipe, the numbers (forward, gradients, FP8 state) are those of the hand-written FP8
layers, bit for bit, and the program lowered for CUDA has 3 FP8 GEMMs per projection
(forward, input gradient, weight gradient). The same on 8 host devices under T5X's
``standard_logical_axis_rules``: tests/sharding/test_codebase_sharding.py.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import dtypes

import codebase_layers as cl
import jax_fp8
from helpers import E2E_RECIPES
from jax_fp8.devtools import explain, hlo
from jax_fp8.flax import Fp8Rule, fp8_model, nnx as fnnx

RECIPES = {"delayed": jax_fp8.DelayedScaling(history_len=4),
           "current": jax_fp8.Float8CurrentScaling(),
           "block": jax_fp8.Float8BlockScaling(),
           "mxfp8": jax_fp8.MXFP8BlockScaling()}


def width(name):
    """The model width: block scaling's blocks are 128 wide, MXFP8's 32."""
    return 128 if name == "block" else 32


def fp8_gemms_for_cuda(step, name, *args):
    """The FP8 GEMMs of ``step(*args)`` lowered for CUDA. Delayed and current scaling:
    dots of two FP8 operands in the HLO. Block scaling: its GEMM primitive, and MXFP8
    its scaled dot, in the program's decisions for CUDA (explain), which without the
    CUDA kernel lower to their references here."""
    if name in ("delayed", "current"):
        text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text(
            dialect="hlo")
        return sum(g.fp8 for g in hlo.gemms(text))
    rows = explain.explain(step, *args, platform="cuda")
    if name == "block":
        return sum(r.name == "jax_fp8_block_gemm" for r in rows)
    return sum(r.kind == "gemm" and r.lowering.startswith("mxfp8") for r in rows)


def linen_step(model):
    """Loss, and its gradient w.r.t. the variables (params and FP8 state) and the input."""
    def loss(variables, x):
        return jnp.mean(model.apply(variables, x).astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))


LINEN = {
    "t5x": (lambda e, fp8=None: cl.T5xBlock(num_heads=2, head_dim=e // 2, mlp_dim=2 * e,
                                            fp8=fp8), cl.T5X_PROJECTIONS),
    "maxtext": (lambda e, fp8=None: cl.MaxTextMlpBlock(intermediate_dim=2 * e, fp8=fp8),
                cl.MAXTEXT_PROJECTIONS),
}


@pytest.mark.parametrize("name", E2E_RECIPES)   # helpers.E2E_RECIPES: one recipe per codebase
@pytest.mark.parametrize("codebase", sorted(LINEN))
def test_linen_codebase_layers_convert_to_the_hand_written_fp8_layers(codebase, name):
    make, projections = LINEN[codebase]
    recipe, e = RECIPES[name], width(name)
    x = jax.random.normal(jax.random.key(0), (2, 16, e))
    hand = make(e, recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing left out of FP8: no warning
        converted = fp8_model(make(e), Fp8Rule(recipe=recipe))
        variables = jax.jit(hand.init)(jax.random.key(1), x)
        # the converted model's variables: their structure, from its traced init (not op by op)
        assert jax.tree.structure(jax.eval_shape(converted.init, jax.random.key(1), x)) == \
            jax.tree.structure(variables)
        got = jax.jit(linen_step(converted))(variables, x)
    want = jax.jit(linen_step(hand))(variables, x)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert fp8_gemms_for_cuda(linen_step(converted), name, variables, x) == 3 * projections
    if name == "delayed":    # one state per projection, under the weight's name
        fp8 = jax.tree_util.tree_flatten_with_path(variables["fp8_meta"])[0]
        assert len({jax.tree_util.keystr(p[:-2]) for p, _ in fp8}) == projections


def nnx_pair(recipe, e):
    """The hand-written FP8 block and the converted one, on one device (the kernels' logical
    axes kept as metadata: no mesh to shard them eagerly over)."""
    x = jax.random.normal(jax.random.key(0), (2, 16, e))
    with nnx.use_eager_sharding(False):
        hand = cl.NnxMlpBlock(e, intermediate_dim=2 * e, fp8=recipe, rngs=nnx.Rngs(1))
        plain = cl.NnxMlpBlock(e, intermediate_dim=2 * e, rngs=nnx.Rngs(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = fp8_model(plain, Fp8Rule(recipe=recipe), x)
    return hand, converted, x


def nnx_step(graphdef):
    """Loss, and its gradient w.r.t. the parameters, the FP8 state and the input."""
    def step(state, x):
        model = nnx.merge(graphdef, state)

        def loss(model, x):
            return jnp.mean(model(x).astype(jnp.float32) ** 2)
        diff = nnx.DiffState(0, nnx.Any(nnx.Param, fnnx.Fp8State))
        out, grads = nnx.value_and_grad(loss, argnums=(diff, 1))(model, x)
        return out, jax.tree.leaves(grads)
    return step


@pytest.mark.parametrize("name", E2E_RECIPES)
def test_nnx_maxtext_layers_convert_to_the_hand_written_fp8_layers(name):
    hand, converted, x = nnx_pair(RECIPES[name], width(name))
    for module in (converted.wi, converted.wo):   # the weight's FP8 module, by its name
        assert isinstance(module.kernel_fp8, fnnx.Fp8DotGeneral)
    g_hand, s_hand = nnx.split(hand)
    g_conv, s_conv = nnx.split(converted)
    assert jax.tree.structure(nnx.to_pure_dict(s_hand)) == \
        jax.tree.structure(nnx.to_pure_dict(s_conv))
    got = jax.jit(nnx_step(g_conv))(s_conv, x)
    want = jax.jit(nnx_step(g_hand))(s_hand, x)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert fp8_gemms_for_cuda(nnx_step(g_conv), name, s_conv, x) == \
        3 * cl.MAXTEXT_PROJECTIONS


CHAINS = {
    # What the large linen codebases write between self.param and the GEMM.
    "astype": lambda x, w: (x, w.astype(jnp.bfloat16).reshape(32, 16)),
    "transpose": lambda x, w: (x, jnp.transpose(w.reshape(32, 16)).T),
    "lax.squeeze": lambda x, w: (x, jax.lax.squeeze(w, (1,))),
    "promote_dtype": lambda x, w: dtypes.promote_dtype(x, w.reshape(32, 16),
                                                       dtype=jnp.bfloat16),
    "logical_constraint": lambda x, w: (x, nn.with_logical_constraint(
        jnp.reshape(w, (32, 16)), ("embed", "mlp"))),
}


class ChainLayer(nn.Module):
    """A module's own GEMM of its parameter ``w`` [32, 1, 16], given to the GEMM through
    ``chain``; ``fp8``: the hand-written FP8 layer (``Fp8DotGeneral`` named ``w_fp8``)."""
    chain: str
    fp8: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (32, 1, 16))
        x, w = CHAINS[self.chain](x, w)
        if self.fp8:
            return jax_fp8.flax.Fp8DotGeneral(name="w_fp8")(x, w, (((1,), (0,)), ((), ())))
        return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_each_followed_chain_is_the_weights_fp8_gemm(chain):
    """Each operation the conversion follows, alone, between the parameter and the GEMM:
    the weight's state (``w_fp8``), the numbers of the hand-written layer."""
    x = jax.random.normal(jax.random.key(0), (16, 32))
    hand = ChainLayer(chain, fp8=True)
    variables = hand.init(jax.random.key(1), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = fp8_model(ChainLayer(chain))
        assert jax.tree.structure(converted.init(jax.random.key(1), x)) == \
            jax.tree.structure(variables)
        got = linen_step(converted)(variables, x)
    jax.tree.map(np.testing.assert_array_equal, got, linen_step(hand)(variables, x))


def test_follow_names_the_steps_from_the_parameter():
    from jax_fp8 import interception

    w = jnp.ones((4, 8))
    with interception.reporting(None, "test"), interception.patched():
        interception.track(w)
        v = jnp.reshape(jnp.asarray(w, jnp.bfloat16), (2, 2, 8)).T
        assert interception.follow(v) == (w, ("cast", "reshape", "transpose"))
        assert interception.follow(v * 2)[0] is not w       # arithmetic: not followed
        assert interception.follow(w[:2])[0] is not w       # a slice: not followed
    assert interception.follow(v) == (v, ())                # only inside the call
