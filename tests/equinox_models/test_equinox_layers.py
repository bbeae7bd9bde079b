"""jax_fp8.equinox's layers and conversion: Fp8Linear as a drop-in for eqx.nn.Linear, one FP8
GEMM per vmap batch (amaxes and min_fp8_flops of the batch), fp8_model on models written as
Equinox's examples write them, every recipe; bit for bit against the functional ops."""

import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import jax_fp8
import jax_fp8.equinox as jfe
from eqx_models import Projection, ScannedMLP, Transformer, mse
from helpers import E2E_RECIPES
from jax_fp8 import Fp8Meta, Fp8Rule

DN = (((1,), (1,)), ((), ()))          # x [B, in] . weight [out, in]
RECIPES = {"delayed": jax_fp8.DelayedScaling(history_len=4),
           "current": jax_fp8.Float8CurrentScaling(),
           "block": jax_fp8.Float8BlockScaling()}
assert_equal = np.testing.assert_array_equal


def _reference(x, weight, bias, meta, dn=DN):
    y, _ = jax_fp8.fp8_dot_general(x, weight, dn, meta)
    return y + bias


def test_equinox_package_imports_no_flax():
    code = ("import sys, jax_fp8.equinox; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'flax'], 'flax'")
    import subprocess
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fp8_linear_has_eqx_linear_fields_and_call():
    key = jr.key(0)
    ref = eqx.nn.Linear(16, 8, key=key)
    layer = jfe.Fp8Linear(16, 8, key=key)
    assert_equal(layer.weight, ref.weight)
    assert_equal(layer.bias, ref.bias)
    assert (layer.in_features, layer.out_features, layer.use_bias) == (16, 8, True)
    assert isinstance(layer.fp8, jfe.Fp8State) and layer.fp8.meta.input.scale.shape == ()
    with pytest.raises(ValueError, match="under jax.vmap"):
        layer(jnp.ones((2, 16)))
    scalar = jfe.Fp8Linear("scalar", "scalar", key=key)
    assert scalar(jnp.float32(2.0)).shape == ()
    assert jfe.Fp8Linear(16, 8, use_bias=False, key=key).bias is None


@pytest.mark.parametrize("name", E2E_RECIPES)   # helpers.E2E_RECIPES: one recipe per framework
def test_vmapped_layer_is_the_batched_fp8_gemm_bit_for_bit(name):
    """Forward and every gradient (input, weight, bias, FP8 state) of ``jax.vmap(layer)``
    equal those of ONE fp8_dot_general over the batch: the kernel gradient contracts over
    the batch in one GEMM (not per example, then summed), the amaxes are the batch's."""
    recipe, d = RECIPES[name], 128
    kx, kw, kc = jr.split(jr.key(1), 3)
    layer = jfe.Fp8Linear.from_linear(eqx.nn.Linear(d, d, key=kw), recipe)
    x = jr.normal(kx, (16, d)) * 3
    c = jr.normal(kc, (16, d))

    def loss(layer, x):
        return jnp.sum(jax.vmap(layer)(x) * c)

    def ref_loss(w, b, meta, x):
        return jnp.sum(_reference(x, w, b, meta) * c)

    assert_equal(jax.vmap(layer)(x), _reference(x, layer.weight, layer.bias, layer.fp8.meta))
    grads, gx = jax.grad(loss, argnums=(0, 1))(layer, x)
    rw, rb, rmeta, rx = jax.grad(ref_loss, argnums=(0, 1, 2, 3))(
        layer.weight, layer.bias, layer.fp8.meta, x)
    assert_equal(grads.weight, rw)
    assert_equal(grads.bias, rb)
    assert_equal(gx, rx)
    for got, want in zip(jax.tree.leaves(grads.fp8.meta), jax.tree.leaves(rmeta)):
        assert_equal(got, want)
    if name == "delayed":
        assert grads.fp8.meta.input.amax_history[0] == jnp.max(jnp.abs(x))
        assert grads.fp8.meta.kernel.amax_history[0] == jnp.max(jnp.abs(layer.weight))


def test_nested_vmaps_fold_into_one_gemm():
    """A block vmaps its layers over the sequence, the loss over the batch: one GEMM of
    [batch, seq] rows, bit for bit."""
    kx, kw = jr.split(jr.key(2))
    layer = jfe.fp8_model(eqx.nn.Linear(32, 16, key=kw), Fp8Rule(min_fp8_flops=0))
    x = jr.normal(kx, (3, 5, 32))
    dn = (((2,), (1,)), ((), ()))

    def loss(layer):
        return jnp.sum(jax.vmap(jax.vmap(layer))(x) ** 2)

    def ref_loss(w, meta):
        return jnp.sum(_reference(x, w, layer.bias, meta, dn) ** 2)

    g = jax.grad(loss)(layer)
    rw, rmeta = jax.grad(ref_loss, argnums=(0, 1))(layer.weight, layer.fp8.meta)
    assert_equal(g.weight, rw)
    assert_equal(g.fp8.meta.grad.amax_history, rmeta.grad.amax_history)


def test_min_fp8_flops_counts_the_vmapped_batch():
    """min_fp8_flops between one example's FLOPs and the batch's: the vmapped call runs in
    FP8, the same layer on one example stays in float32."""
    kx, kw = jr.split(jr.key(3))
    one = 2 * 32 * 16
    layer = jfe.Fp8Linear.from_linear(eqx.nn.Linear(32, 16, key=kw), min_fp8_flops=4 * one)
    x = jr.normal(kx, (8, 32))
    meta = Fp8Meta.create()
    assert_equal(jax.vmap(layer)(x), _reference(x, layer.weight, layer.bias, meta))
    kept = jax.lax.dot_general(x[0], layer.weight, (((0,), (1,)), ((), ())))
    assert_equal(layer(x[0]), kept + layer.bias)
    assert not np.array_equal(layer(x[0]), jax.vmap(layer)(x)[0])
    small = jax.vmap(layer)(x[:2])          # 2 examples: below the threshold
    assert_equal(small, jax.lax.dot_general(x[:2], layer.weight, DN) + layer.bias)


def test_vmap_over_stacked_layers_is_the_fp8_ops_own_batching():
    """vmap over layers (batched weights and states: an ensemble) runs each layer's GEMM
    with its own state: the same bits as calling each layer."""
    keys = jr.split(jr.key(4), 3)
    stacked = eqx.filter_vmap(lambda k: jfe.Fp8Linear(32, 16, key=k))(keys)
    assert stacked.fp8.meta.input.scale.shape == (3,)
    x = jr.normal(jr.key(5), (3, 32))
    got = eqx.filter_vmap(lambda layer, x: layer(x))(stacked, x)
    for i in range(3):
        layer = jax.tree.map(lambda a, i=i: a[i], stacked)
        assert_equal(got[i], layer(x[i]))


def test_fp8_model_converts_a_transformer_keeping_its_call_and_classes():
    key = jr.key(6)
    model = Transformer(64, 32, 64, 4, 2, key=key)
    rules = (Fp8Rule(path="head", recipe=None), Fp8Rule(min_fp8_flops=0))
    fp8 = jfe.fp8_model(model, rules)
    attention = fp8.layers[1].attention_block.attention
    assert isinstance(attention, eqx.nn.MultiheadAttention)
    for proj in (attention.query_proj, attention.key_proj, attention.value_proj,
                 attention.output_proj, fp8.layers[0].ff_block.mlp):
        assert isinstance(proj, jfe.Fp8Linear)
    assert type(fp8.head) is eqx.nn.Linear                      # excluded by its rule
    assert_equal(fp8.layers[0].ff_block.mlp.weight, model.layers[0].ff_block.mlp.weight)
    assert len(jfe.fp8_states(fp8)) == 2 * 6
    assert jfe.fp8_states(fp8)[0][0] == ".layers[0].attention_block.attention.query_proj.fp8"
    assert type(model.head) is eqx.nn.Linear and not jfe.fp8_states(model)   # unchanged
    tokens = jr.randint(key, (5,), 0, 64)
    out = eqx.filter_jit(fp8)(tokens)                             # the same call
    assert out.shape == (5, 64)
    assert jfe.fp8_model(fp8, rules) is not None
    assert len(jfe.fp8_states(jfe.fp8_model(fp8, rules))) == 12   # converting twice: no-op


def test_fp8_model_rule_paths_name_fields_and_indices():
    model = Transformer(64, 32, 64, 4, 2, key=jr.key(7))
    fp8 = jfe.fp8_model(model, (Fp8Rule(path="layers/1/.*"), ))
    assert type(fp8.layers[0].ff_block.mlp) is eqx.nn.Linear
    assert isinstance(fp8.layers[1].ff_block.mlp, jfe.Fp8Linear)
    assert type(fp8.head) is eqx.nn.Linear
    with pytest.raises(TypeError, match="Fp8Rule"):
        jfe.fp8_model(model, "layers")


def test_module_of_ones_own_weight_gemms_run_in_fp8():
    """A module's own einsum / lax.dot_general of its weights: each weight's GEMMs with
    that weight's state, bit for bit as the functional ops; the module keeps its class."""
    key = jr.key(8)
    model = Projection(32, 16, key=key)
    fp8 = jfe.fp8_model(model, Fp8Rule(min_fp8_flops=0))
    assert isinstance(fp8, Projection) and sorted(fp8.fp8_states) == ["gate", "kernel"]
    assert_equal(fp8.kernel, model.kernel)
    x = jr.normal(key, (4, 6, 32))
    up, _ = jax_fp8.fp8_einsum("bsd,dh->bsh", x, model.kernel, Fp8Meta.create())
    gate, _ = jax_fp8.fp8_dot_general(x, model.gate, (((2,), (0,)), ((), ())),
                                      Fp8Meta.create())
    assert_equal(jax.vmap(fp8)(x), up * jax.nn.sigmoid(gate))
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(fp8)
    for name in ("kernel", "gate"):
        assert grads.fp8_states[name].meta.input.amax_history[0] == jnp.max(jnp.abs(x))


class TwiceUsed(eqx.Module):
    kernel: jax.Array

    def __call__(self, x):
        return jnp.einsum("d,dh->h", x, self.kernel) + jnp.einsum("d,dh->h", 2 * x, self.kernel)


def test_a_weight_used_twice_in_one_call_threads_its_state():
    model = jfe.fp8_model(TwiceUsed(jr.normal(jr.key(9), (16, 8))), Fp8Rule(min_fp8_flops=0))
    x = jr.normal(jr.key(10), (16,))
    g = eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)
    assert g.fp8_states["kernel"].meta.input.amax_history[0] == 2 * jnp.max(jnp.abs(x))


class Scores(eqx.Module):
    def __call__(self, q, k):
        return jnp.einsum("qd,kd->qk", q, k)


def test_activation_gemms_need_a_stateless_recipe():
    with pytest.raises(ValueError, match="activations=True"):
        jfe.fp8_model(Scores(), Fp8Rule(activations=True, min_fp8_flops=0))
    model = jfe.fp8_model(Scores(), Fp8Rule(recipe=jax_fp8.Float8CurrentScaling(),
                                            activations=True, min_fp8_flops=0))
    q, k = jr.normal(jr.key(11), (2, 8, 32)), jr.normal(jr.key(12), (2, 8, 32))
    want, _ = jax_fp8.fp8_einsum("bqd,bkd->bqk", q, k,
                                 Fp8Meta.create(jax_fp8.Float8CurrentScaling()))
    assert_equal(jax.vmap(model)(q, k), want)


def test_stacked_layers_scanned_get_one_state_per_layer():
    model = ScannedMLP(32, 3, key=jr.key(13))
    fp8 = jfe.fp8_model(model, Fp8Rule(min_fp8_flops=0))
    assert fp8.layers.fp8.meta.input.amax_history.shape == (3, 1024)
    x, y = jr.normal(jr.key(14), (4, 32)), jr.normal(jr.key(15), (4, 32))
    grads = eqx.filter_grad(mse)(fp8, x, y)
    observed = grads.layers.fp8.meta.input.amax_history[:, 0]
    assert observed[0] == jnp.max(jnp.abs(x)) and len(set(np.asarray(observed))) == 3


class Shared(eqx.Module):
    """One eqx.nn.Linear applied twice (a shared layer)."""

    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(jax.nn.gelu(self.linear(x)))


def test_a_shared_layer_called_twice_threads_its_state():
    """Both calls' amaxes combine by max (not summed, not an error), under vmap too."""
    model = jfe.fp8_model(Shared(eqx.nn.Linear(16, 16, key=jr.key(16))),
                          Fp8Rule(min_fp8_flops=0))
    x = jr.normal(jr.key(17), (4, 16)) * 0.1
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model)
    hidden = jax.nn.gelu(jax.vmap(model.linear)(x))
    want = jnp.maximum(jnp.max(jnp.abs(x)), jnp.max(jnp.abs(hidden)))
    assert grads.linear.fp8.meta.input.amax_history[0] == want
    assert grads.linear.fp8.meta.kernel.amax_history[0] == jnp.max(jnp.abs(model.linear.weight))


class TransposedAndCast(eqx.Module):
    """Weights used as codebases write them: ``x @ self.w.T`` (a weight stored [out, in], as
    eqx.nn.Linear stores it) and ``x @ self.v.astype(jnp.bfloat16)`` (a mixed-precision
    layer)."""

    w: jax.Array
    v: jax.Array

    def __call__(self, x):
        h = x @ self.w.T
        return h.astype(jnp.bfloat16) @ self.v.astype(jnp.bfloat16)


def test_a_weight_transposed_or_cast_before_its_gemm_converts():
    """The conversion follows a weight through a transpose or a cast to its GEMM (as the
    Flax adapters do): both GEMMs run in FP8 with the weight's state, and nothing is
    reported."""
    model = TransposedAndCast(jr.normal(jr.key(20), (16, 32)), jr.normal(jr.key(21), (16, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jax_fp8.Fp8ConversionWarning)
        fp8 = jfe.fp8_model(model, Fp8Rule(min_fp8_flops=0))
        x = jr.normal(jr.key(22), (4, 32))
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(fp8)
    assert sorted(fp8.fp8_states) == ["v", "w"]
    w_meta, v_meta = grads.fp8_states["w"].meta, grads.fp8_states["v"].meta
    assert w_meta.input.amax_history[0] == jnp.max(jnp.abs(x))
    assert w_meta.kernel.amax_history[0] == jnp.max(jnp.abs(model.w))
    h = (x @ model.w.T).astype(jnp.bfloat16)
    assert v_meta.kernel.amax_history[0] == jnp.max(jnp.abs(model.v.astype(jnp.bfloat16)))
    # The second GEMM's input is the first's FP8 output, close to the plain product.
    np.testing.assert_allclose(v_meta.input.amax_history[0], jnp.max(jnp.abs(h)), rtol=0.1)
