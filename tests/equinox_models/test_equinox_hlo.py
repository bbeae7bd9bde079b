"""The train step of an Equinox transformer converted by jax_fp8.equinox.fp8_model, lowered
for CUDA (no GPU needed): 3 FP8 GEMMs per projection (forward, input gradient, weight
gradient), each one GEMM over the whole batch; and the same step trains under every
recipe."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import jax_fp8
import jax_fp8.equinox as jfe
from eqx_models import Transformer, lm_train_step
from helpers import E2E_RECIPES
from jax_fp8.devtools import hlo

RECIPES = {"delayed": jax_fp8.DelayedScaling(history_len=8),
           "current": jax_fp8.Float8CurrentScaling(),
           "block": jax_fp8.Float8BlockScaling()}
optim = optax.adamw(1e-3)


def _converted(recipe, hidden=32, layers=2):
    model = Transformer(64, hidden, 2 * hidden, 4, layers, key=jr.key(0))
    return jfe.fp8_model(model, jax_fp8.Fp8Rule(recipe=recipe, min_fp8_flops=0))


def test_cuda_train_step_has_three_fp8_gemms_per_projection_over_the_batch():
    model = _converted(RECIPES["delayed"])
    dynamic, static = eqx.partition(model, eqx.is_array)
    tokens = jr.randint(jr.key(1), (4, 9), 0, 64)
    lowered = jax.jit(lm_train_step(static, optim)).trace(
        dynamic, optim.init(jfe.params(model)), tokens).lower(lowering_platforms=("cuda",))
    text = lowered.as_text(dialect="hlo")
    gemms = hlo.gemms(text)
    projections = len(jfe.fp8_states(model))
    assert projections == 13       # 2 layers x (q, k, v, o, mlp, output) + head
    assert sum(g.fp8 for g in gemms) == 3 * projections
    # The rest: attention's q.k and p.v (activations, kept), forward and 2 gradients.
    assert len(gemms) - 3 * projections == 2 * 6
    # Each FP8 GEMM sees the whole batch: its operands hold 4 x 8 rows (tokens), none is
    # a per-example GEMM batched over examples then summed.
    sizes = hlo.gemm_sizes(text)
    fp8_names = {g.name for g in gemms if g.fp8}
    for name in fp8_names:
        size = sizes[name]
        assert size.batch == 1 and 4 * 8 in (size.m, size.n, size.k), (name, size)


@pytest.mark.parametrize("name", E2E_RECIPES)   # helpers.E2E_RECIPES: one recipe per framework
def test_every_recipe_trains(name):
    # Block scaling's blocks are 128 wide: a model that wide, one layer (CPU time).
    model = _converted(RECIPES[name], hidden=128 if name == "block" else 32, layers=1)
    dynamic, static = eqx.partition(model, eqx.is_array)
    opt_state = optim.init(jfe.params(model))
    tokens = jr.randint(jr.key(1), (2, 9), 0, 64)
    step = jax.jit(lm_train_step(static, optim))
    losses = []
    for _ in range(2):
        dynamic, opt_state, loss = step(dynamic, opt_state, tokens)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    trained = eqx.combine(dynamic, static)
    if name == "delayed":
        jfe.check_fp8_updated(trained)
    else:
        assert all(s.meta.stateless for _, s in jfe.fp8_states(trained))
    # Inference with the trained model, compiled (run eagerly, its FP8 GEMMs and attention go
    # op by op: seconds; eager calls of converted models are test_equinox_layers.py's).
    out = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(trained, tokens)
    assert out.shape == (2, 9, 64) and out.dtype == jnp.float32
