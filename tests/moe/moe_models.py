"""Mixture-of-experts blocks written the way public JAX MoE code writes them (no jax_fp8 import).

NNX (`NnxMoeBlock`), in the style of the Qwen3-MoE blocks of JAX NNX ports (skyrl-tx's
``Qwen3MoeSparseMoeBlock``, bonsai's qwen3): a router ``nnx.Linear``, softmax and top-k,
every token repeated for its k experts, sorted by expert (argsort), group sizes by
bincount, ``jax.lax.ragged_dot`` with the experts' ``nnx.Param`` gate / up / down weights,
unsort, and the routing-weighted sum.

Linen (`LinenMoeBlock`), in the style of MaxText's ``RoutedMoE`` (sparse matmul path): the
router a ``DenseGeneral``, the experts' kernels ``wi_0`` / ``wi_1`` / ``wo`` from
``self.param``, the same permute / ``ragged_dot`` / unpermute.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


def prepare_routing(tokens, selected_experts, num_experts):
    """tokens sorted by expert: (sorted tokens, group sizes, the indices that unsort)."""
    sort_indices = jnp.argsort(selected_experts)
    sorted_tokens = tokens[sort_indices]
    group_sizes = jnp.bincount(selected_experts, length=num_experts).astype(jnp.int32)
    unsort_indices = jnp.argsort(sort_indices)
    return sorted_tokens, group_sizes, unsort_indices


class NnxExperts(nnx.Module):
    def __init__(self, num_experts, hidden, intermediate, top_k, *, dtype, rngs):
        init = nnx.initializers.lecun_normal()
        self.num_experts, self.top_k, self.hidden = num_experts, top_k, hidden
        self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate),
                                        dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate),
                                      dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, intermediate, hidden),
                                        dtype))

    def __call__(self, hidden_states, router_logits):
        routing_weights = jax.nn.softmax(router_logits, axis=-1)
        routing_weights, selected_experts = jax.lax.top_k(routing_weights, self.top_k)
        routing_weights = routing_weights / jnp.sum(routing_weights, axis=-1, keepdims=True)

        selected_experts_flat = selected_experts.ravel()
        hidden_states_expanded = jnp.repeat(hidden_states, self.top_k, axis=0)
        hidden_states_sorted, group_sizes, unsort_indices = prepare_routing(
            hidden_states_expanded, selected_experts_flat, self.num_experts)

        gate_out = jax.lax.ragged_dot(hidden_states_sorted, self.gate_proj.value, group_sizes)
        up_out = jax.lax.ragged_dot(hidden_states_sorted, self.up_proj.value, group_sizes)
        down_out = jax.lax.ragged_dot(nnx.silu(gate_out) * up_out, self.down_proj.value,
                                      group_sizes)

        unsorted_out = down_out[unsort_indices]
        reshaped_out = unsorted_out.reshape(-1, self.top_k, self.hidden)
        return jnp.sum(reshaped_out * routing_weights[..., None].astype(reshaped_out.dtype),
                       axis=1)


class NnxMoeBlock(nnx.Module):
    def __init__(self, num_experts=8, hidden=64, intermediate=32, top_k=2, *,
                 dtype=jnp.float32, rngs):
        self.gate = nnx.Linear(hidden, num_experts, use_bias=False, dtype=dtype,
                               param_dtype=dtype, rngs=rngs)
        self.experts = NnxExperts(num_experts, hidden, intermediate, top_k, dtype=dtype,
                                  rngs=rngs)

    def __call__(self, hidden_states):
        batch_size, seq_len, hidden_size = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_size)
        router_logits = self.gate(hidden_states)
        out = self.experts(hidden_states, router_logits)
        return out.reshape(batch_size, seq_len, hidden_size)


class LinenMoeBlock(nn.Module):
    num_experts: int = 8
    num_experts_per_tok: int = 2
    emb_dim: int = 64
    mlp_dim: int = 32
    dtype: jnp.dtype = jnp.float32

    def permute(self, inputs, gate_logits):
        inputs_2d = inputs.reshape(-1, inputs.shape[-1])
        weights, selected_experts = jax.lax.top_k(gate_logits, self.num_experts_per_tok)
        flatten_selected_experts = jnp.ravel(selected_experts)
        sorted_selected_experts = jnp.argsort(flatten_selected_experts)
        sorted_indices = sorted_selected_experts // self.num_experts_per_tok
        sorted_inputs = jnp.take(inputs_2d, indices=sorted_indices, axis=0).astype(self.dtype)
        group_size = jnp.bincount(flatten_selected_experts, length=self.num_experts)
        return sorted_inputs, sorted_selected_experts, weights, group_size.astype(jnp.int32)

    def unpermute(self, intermediate, sorted_selected_experts, weights, batch_size, seq_len):
        unsort_intermediate = jnp.take(intermediate, indices=jnp.argsort(sorted_selected_experts),
                                       axis=0)
        reshaped_weights = jnp.reshape(weights, (-1, self.num_experts_per_tok))
        reshaped_intermediate = jnp.reshape(
            unsort_intermediate, (reshaped_weights.shape[0], self.num_experts_per_tok, -1))
        output = jnp.einsum("BKE,BK -> BE", reshaped_intermediate,
                            reshaped_weights.astype(reshaped_intermediate.dtype))
        return output.reshape(batch_size, seq_len, -1).astype(self.dtype)

    @nn.compact
    def __call__(self, inputs):
        batch_size, seq_len, _ = inputs.shape
        gate_logits = nn.DenseGeneral(self.num_experts, use_bias=False, dtype=self.dtype,
                                      name="gate")(inputs)
        gate_logits = jax.nn.softmax(gate_logits.reshape(-1, self.num_experts), axis=-1)
        init = nn.initializers.lecun_normal()
        w0 = self.param("wi_0", init, (self.num_experts, self.emb_dim, self.mlp_dim))
        w1 = self.param("wi_1", init, (self.num_experts, self.emb_dim, self.mlp_dim))
        wo = self.param("wo", init, (self.num_experts, self.mlp_dim, self.emb_dim))
        x, sorted_selected_experts, weights, group_sizes = self.permute(inputs, gate_logits)
        layer_w0 = jax.lax.ragged_dot(x, w0, group_sizes)
        layer_w1 = jax.lax.ragged_dot(x, w1, group_sizes)
        intermediate = nn.silu(layer_w0) * layer_w1
        intermediate = jax.lax.ragged_dot(intermediate, wo, group_sizes)
        return self.unpermute(intermediate, sorted_selected_experts, weights, batch_size,
                              seq_len)
