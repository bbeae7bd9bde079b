"""``min_fp8_flops``: GEMMs too small to gain from FP8 run in the operands' dtype, with the
bits of ``lax.dot_general``; larger ones are untouched; bad values are errors naming the
argument; Flax linen / NNX layers pass it through."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
from helpers import assert_bits_equal
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState
from jax_fp8.gemm.dot_general import gemm_flops

DN = (((1,), (0,)), ((), ()))
rng = np.random.default_rng(0)
X = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
W = jnp.asarray(rng.standard_normal((32, 8)) * 0.1, jnp.bfloat16)
FLOPS = 2 * 16 * 32 * 8


def _has_fp8(fn, *args) -> bool:
    text = str(jax.make_jaxpr(fn)(*args))
    return "f8_e4m3fn" in text or "f8_e5m2" in text


def test_gemm_flops_counts_batch_free_and_contracting_axes():
    assert gemm_flops(X.shape, W.shape, DN) == FLOPS
    dn = (((2,), (1,)), ((0,), (0,)))   # [b, m, k] x [b, k, n]
    assert gemm_flops((3, 5, 7), (3, 7, 11), dn) == 2 * 3 * 5 * 11 * 7


@pytest.mark.parametrize("recipe", [jax_fp8.DelayedScaling(history_len=4),
                                    jax_fp8.Float8CurrentScaling(), jax_fp8.Float8BlockScaling()])
def test_a_small_gemm_runs_as_lax_dot_general(recipe):
    meta = jax_fp8.Fp8Meta.create(recipe)

    def f(x, w, meta):
        return jax_fp8.fp8_dot_general(x, w, DN, meta, min_fp8_flops=FLOPS + 1)

    out, meta_out = jax.jit(f)(X, W, meta)
    assert_bits_equal(out, jax.jit(lambda x, w: jax.lax.dot_general(x, w, DN))(X, W), "out")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), meta_out, meta))
    assert not _has_fp8(f, X, W, meta)

    def loss(x, w, meta):
        return jnp.sum(f(x, w, meta)[0].astype(jnp.float32) ** 2)

    def plain(x, w):
        return jnp.sum(jax.lax.dot_general(x, w, DN).astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(X, W, meta)
    want = jax.jit(jax.grad(plain, argnums=(0, 1)))(X, W)
    assert_bits_equal(grads[0], want[0], "dx")
    assert_bits_equal(grads[1], want[1], "dw")
    for leaf in jax.tree.leaves(grads[2]):    # no amax observed
        assert not np.any(np.asarray(leaf))


def test_a_gemm_at_the_threshold_stays_fp8():
    meta = jax_fp8.Fp8Meta.create(jax_fp8.DelayedScaling(history_len=4))
    want = jax_fp8.fp8_dot_general(X, W, DN, meta)[0]
    got = jax_fp8.fp8_dot_general(X, W, DN, meta, min_fp8_flops=FLOPS)[0]
    assert_bits_equal(got, want, "out")
    assert _has_fp8(lambda x, w, m: jax_fp8.fp8_dot_general(x, w, DN, m, min_fp8_flops=FLOPS),
                    X, W, meta)


@pytest.mark.parametrize("bad, error", [(True, TypeError), ("1e9", TypeError), (None, TypeError),
                                        (-1, ValueError), (float("nan"), ValueError)])
def test_bad_min_fp8_flops_is_an_error_naming_it(bad, error):
    meta = jax_fp8.Fp8Meta.create()
    with pytest.raises(error, match="min_fp8_flops"):
        jax_fp8.fp8_dot_general(X, W, DN, meta, min_fp8_flops=bad)
    with pytest.raises(error, match="min_fp8_flops"):
        jax_fp8.flax.nnx.Fp8DotGeneral(min_fp8_flops=bad)


def test_einsum_passes_it_through():
    meta = jax_fp8.Fp8Meta.create(jax_fp8.DelayedScaling(history_len=4))
    out, _ = jax_fp8.fp8_einsum("mk,kn->mn", X, W, meta, min_fp8_flops=FLOPS + 1)
    assert_bits_equal(out, jax.lax.dot_general(X, W, DN), "out")


class TwoLayers(nn.Module):
    """A small Dense (16x32x8 per GEMM) and a large one (16x32x512), one policy."""

    @nn.compact
    def __call__(self, x):
        dg = functools.partial(Fp8DotGeneral, min_fp8_flops=FLOPS + 1,
                               recipe=jax_fp8.DelayedScaling(history_len=4))
        h = nn.Dense(8, dtype=jnp.bfloat16, dot_general_cls=dg, name="small")(x)
        return nn.Dense(512, dtype=jnp.bfloat16, dot_general_cls=dg, name="large")(
            jnp.tile(h, (1, 4)))


def test_linen_layers_keep_small_gemms_out_of_fp8():
    model = TwoLayers()
    variables = model.init(jax.random.key(0), X)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1),
                                 recipe=jax_fp8.DelayedScaling(history_len=4), pack_fp8=False)

    @jax.jit
    def step(state):
        def loss(params, fp8):
            return jnp.mean(state.apply_model(params, fp8, X).astype(jnp.float32) ** 2)
        grads, fp8_grads = jax.grad(loss, argnums=(0, 1))(state.params, state.fp8)
        return state.apply_gradients(grads=grads, fp8_grads=fp8_grads)

    fp8 = step(state).fp8
    for name in ("input", "kernel", "grad"):
        assert np.all(np.asarray(fp8["small"]["Fp8DotGeneral_0"][name].amax_history) == 0), name
        assert np.any(np.asarray(fp8["large"]["Fp8DotGeneral_0"][name].amax_history) > 0), name


def test_nnx_linear_keeps_a_small_gemm_out_of_fp8():
    x = jnp.asarray(X, jnp.float32)
    lin = jax_fp8.flax.nnx.Fp8Linear(32, 8, min_fp8_flops=FLOPS + 1, rngs=nnx.Rngs(0))
    plain = nnx.Linear(32, 8, rngs=nnx.Rngs(0))
    assert_bits_equal(lin(x), plain(x), "out")
    loss, grads = jax_fp8.flax.nnx.fp8_value_and_grad(lambda m: jnp.sum(m(x)))(lin)
    fp8_grads = jax_fp8.flax.nnx.fp8_state(grads)
    assert all(not np.any(np.asarray(leaf))
               for leaf in jax.tree.leaves(jax_fp8.amax_cotangents(fp8_grads)))
