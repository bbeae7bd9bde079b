"""Mixture-of-experts blocks written the way public JAX MoE code writes them (no jax_fp8 import).

NNX (`NnxMoeBlock`), in the style of the Qwen3-MoE blocks of JAX NNX ports (skyrl-tx's
``Qwen3MoeSparseMoeBlock``, bonsai's qwen3): a router ``nnx.Linear``, softmax and top-k,
every token repeated for its k experts, sorted by expert (argsort), group sizes by
bincount, ``jax.lax.ragged_dot`` with the experts' ``nnx.Param`` gate / up / down weights,
unsort, and the routing-weighted sum.

Linen (`LinenMoeBlock`), in the style of MaxText's ``RoutedMoE`` (sparse matmul path): the
router a ``DenseGeneral``, the experts' kernels ``wi_0`` / ``wi_1`` / ``wo`` from
``self.param``, the same permute / ``ragged_dot`` / unpermute; `LinenShardMapMoeBlock` and
`NnxShardMapMoeBlock` with the experts inside a ``jax.shard_map`` as that path runs them (the
kernels passed in as arguments), in linen and as MaxText's NNX port writes it.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


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


class RoutedMoeMethods:
    """MaxText's ``RoutedMoE`` routing: permute the tokens by expert, unpermute the results
    (its ``self.num_experts_per_tok`` / ``self.num_experts`` / ``self.dtype``)."""

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


class LinenMoeBlock(RoutedMoeMethods, nn.Module):
    num_experts: int = 8
    num_experts_per_tok: int = 2
    emb_dim: int = 64
    mlp_dim: int = 32
    dtype: jnp.dtype = jnp.float32

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


class ShardMapSparseMatmul(RoutedMoeMethods):
    """MaxText's ``RoutedMoE.sparse_matmul``: the experts' kernels passed as arguments into a
    ``jax.shard_map`` over ``self.mesh`` (tokens split along its ``data`` axis, the kernels
    replicated), cast to the layer's dtype inside, the grouped GEMMs of each device's tokens
    ``jax.lax.ragged_dot`` of the local kernels."""

    def sparse_matmul(self, inputs, gate_logits, w0_kernel, w1_kernel, wo_kernel):
        def gmm(inputs, kernel, group_sizes):
            inputs = inputs.astype(self.dtype)
            kernel = kernel.astype(self.dtype)
            return jax.lax.ragged_dot(lhs=inputs, rhs=kernel, group_sizes=group_sizes,
                                      preferred_element_type=self.dtype)

        batch_pspec = P("data", None, None)

        @functools.partial(
            jax.shard_map,
            mesh=self.mesh,
            in_specs=(batch_pspec, P("data", None), P(), P(), P()),
            out_specs=batch_pspec,
            check_vma=False,
        )
        def wrapper(x, logits, w0, w1, wo):
            batch_size, sequence_length, _ = x.shape
            x, sorted_selected_experts, weights, group_sizes = self.permute(x, logits)
            layer_w0 = gmm(x, w0, group_sizes)
            layer_w1 = gmm(x, w1, group_sizes)
            intermediate_layer = nn.silu(layer_w0) * layer_w1
            intermediate_output = gmm(intermediate_layer, wo, group_sizes)
            return self.unpermute(intermediate_output, sorted_selected_experts, weights,
                                  batch_size, sequence_length)

        return wrapper(inputs, gate_logits, w0_kernel, w1_kernel, wo_kernel)


class LinenShardMapMoeBlock(ShardMapSparseMatmul, LinenMoeBlock):
    """`LinenMoeBlock` with its experts run as MaxText's ``RoutedMoE`` runs them
    (`ShardMapSparseMatmul`), the kernels cast with ``jnp.asarray`` first as it casts them."""

    mesh: jax.sharding.Mesh | None = None

    @nn.compact
    def __call__(self, inputs):
        gate_logits = nn.DenseGeneral(self.num_experts, use_bias=False, dtype=self.dtype,
                                      name="gate")(inputs)
        gate_logits = jax.nn.softmax(gate_logits.reshape(-1, self.num_experts), axis=-1)
        init = nn.initializers.lecun_normal()
        w0_kernel = self.param("wi_0", init, (self.num_experts, self.emb_dim, self.mlp_dim))
        w1_kernel = self.param("wi_1", init, (self.num_experts, self.emb_dim, self.mlp_dim))
        wo_kernel = self.param("wo", init, (self.num_experts, self.mlp_dim, self.emb_dim))
        w0_kernel = jnp.asarray(w0_kernel, self.dtype)
        w1_kernel = jnp.asarray(w1_kernel, self.dtype)
        wo_kernel = jnp.asarray(wo_kernel, self.dtype)
        return self.sparse_matmul(inputs, gate_logits, w0_kernel, w1_kernel, wo_kernel)


class NnxShardMapMoeBlock(ShardMapSparseMatmul, nnx.Module):
    """`LinenShardMapMoeBlock` as MaxText's NNX ``RoutedMoE`` writes it: ``nnx.Param`` kernels
    read with ``[...]`` and cast with ``jnp.asarray``, the same ``shard_map``'d sparse matmul."""

    def __init__(self, num_experts=8, num_experts_per_tok=2, emb_dim=64, mlp_dim=32, *,
                 mesh, dtype=jnp.float32, rngs):
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.emb_dim, self.mlp_dim, self.dtype, self.mesh = emb_dim, mlp_dim, dtype, mesh
        self.gate = nnx.Linear(emb_dim, num_experts, use_bias=False, dtype=dtype, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.wi_0 = nnx.Param(init(rngs.params(), (num_experts, emb_dim, mlp_dim)))
        self.wi_1 = nnx.Param(init(rngs.params(), (num_experts, emb_dim, mlp_dim)))
        self.wo = nnx.Param(init(rngs.params(), (num_experts, mlp_dim, emb_dim)))

    def __call__(self, inputs):
        gate_logits = self.gate(inputs)
        gate_logits = jax.nn.softmax(gate_logits.reshape(-1, self.num_experts), axis=-1)
        w0_kernel = jnp.asarray(self.wi_0[...], self.dtype)
        w1_kernel = jnp.asarray(self.wi_1[...], self.dtype)
        wo_kernel = jnp.asarray(self.wo[...], self.dtype)
        return self.sparse_matmul(inputs, gate_logits, w0_kernel, w1_kernel, wo_kernel)
