"""Equinox models for the jax_fp8.equinox tests, written the way Equinox's own examples write
them (the BERT example's blocks: ``eqx.nn.MultiheadAttention``, ``jax.vmap`` of each
``eqx.nn.Linear`` / ``LayerNorm`` over the sequence inside the block, the model called per
example and ``jax.vmap``-ed over the batch by the loss)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import jax_fp8.equinox as jfe


class FeedForwardBlock(eqx.Module):
    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    layernorm: eqx.nn.LayerNorm

    def __init__(self, hidden_size, intermediate_size, *, key):
        mlp_key, output_key = jr.split(key)
        self.mlp = eqx.nn.Linear(hidden_size, intermediate_size, key=mlp_key)
        self.output = eqx.nn.Linear(intermediate_size, hidden_size, key=output_key)
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)

    def __call__(self, inputs):
        hidden = jax.vmap(self.mlp)(inputs)
        hidden = jax.nn.gelu(hidden)
        output = jax.vmap(self.output)(hidden)
        return jax.vmap(self.layernorm)(output + inputs)


class AttentionBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    layernorm: eqx.nn.LayerNorm

    def __init__(self, hidden_size, num_heads, *, key):
        self.attention = eqx.nn.MultiheadAttention(num_heads=num_heads, query_size=hidden_size,
                                                   use_query_bias=True, use_key_bias=True,
                                                   use_value_bias=True, use_output_bias=True,
                                                   key=key)
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)

    def __call__(self, inputs, mask=None):
        attention_output = self.attention(query=inputs, key_=inputs, value=inputs, mask=mask)
        return jax.vmap(self.layernorm)(attention_output + inputs)


class TransformerLayer(eqx.Module):
    attention_block: AttentionBlock
    ff_block: FeedForwardBlock

    def __init__(self, hidden_size, intermediate_size, num_heads, *, key):
        attention_key, ff_key = jr.split(key)
        self.attention_block = AttentionBlock(hidden_size, num_heads, key=attention_key)
        self.ff_block = FeedForwardBlock(hidden_size, intermediate_size, key=ff_key)

    def __call__(self, inputs, mask=None):
        return self.ff_block(self.attention_block(inputs, mask))


class Transformer(eqx.Module):
    """A causal LM: token embedding, layers, a head (``model(tokens)`` on one sequence)."""

    embedder: eqx.nn.Embedding
    layers: list
    head: eqx.nn.Linear

    def __init__(self, vocab_size, hidden_size, intermediate_size, num_heads, num_layers,
                 *, key):
        embedder_key, head_key, *layer_keys = jr.split(key, num_layers + 2)
        self.embedder = eqx.nn.Embedding(vocab_size, hidden_size, key=embedder_key)
        self.layers = [TransformerLayer(hidden_size, intermediate_size, num_heads, key=k)
                       for k in layer_keys]
        self.head = eqx.nn.Linear(hidden_size, vocab_size, key=head_key)

    def __call__(self, tokens):
        x = jax.vmap(self.embedder)(tokens)
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
        for layer in self.layers:
            x = layer(x, mask)
        return jax.vmap(self.head)(x)


class ScannedMLP(eqx.Module):
    """Layers stacked by ``eqx.filter_vmap`` over their constructor and run by
    ``jax.lax.scan`` (Equinox's "compile time" idiom for deep models)."""

    layers: eqx.nn.Linear

    def __init__(self, width, depth, *, key):
        make = lambda k: eqx.nn.Linear(width, width, key=k)  # noqa: E731
        self.layers = eqx.filter_vmap(make)(jr.split(key, depth))

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def f(x, dynamic_layer):
            layer = eqx.combine(dynamic_layer, static)
            return jax.nn.gelu(layer(x)), None

        x, _ = jax.lax.scan(f, x, dynamic)
        return x


class Projection(eqx.Module):
    """A module of one's own whose GEMMs are on its own weights (no eqx.nn.Linear)."""

    kernel: jax.Array
    gate: jax.Array

    def __init__(self, d_in, d_out, *, key):
        k1, k2 = jr.split(key)
        self.kernel = jr.normal(k1, (d_in, d_out)) / d_in ** 0.5
        self.gate = jr.normal(k2, (d_in, d_out)) / d_in ** 0.5

    def __call__(self, x):                       # x: [seq, d_in]
        up = jnp.einsum("sd,dh->sh", x, self.kernel)
        gate = jax.lax.dot_general(x, self.gate, (((1,), (0,)), ((), ())))
        return up * jax.nn.sigmoid(gate)


def mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def lm_loss(model, tokens):
    logits = jax.vmap(model)(tokens[:, :-1]).astype(jnp.float32)
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def lm_train_step(static, optim):
    """The train step of the model ``eqx.combine(dynamic, static)`` on `lm_loss` with the
    optax optimizer `optim` over its parameters (``jfe.params``), the FP8 states updated by
    ``jfe.apply_updates``: step(dynamic, opt_state, tokens) -> (the new model's arrays, the
    new opt_state, the loss)."""
    def step(dynamic, opt_state, tokens):
        model = eqx.combine(dynamic, static)
        loss, grads = eqx.filter_value_and_grad(lm_loss)(model, tokens)
        updates, opt_state = optim.update(jfe.params(grads), opt_state, jfe.params(model))
        model = jfe.apply_updates(model, updates, grads)
        return eqx.filter(model, eqx.is_array), opt_state, loss
    return step
