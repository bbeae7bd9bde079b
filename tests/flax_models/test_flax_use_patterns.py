"""Property test: the Flax layers driven through random use patterns (a layer reused k
times, nn.scan over layers, nn.vmap with the FP8 collection broadcast, microbatches,
mutable or immutable collection, jit or not) stage, for every state, exactly the float32
max over all its uses.

The loss is linear in the layer outputs, ``sum(y_use * c_use)``, so the gradient reaching
each use is exactly ``c_use`` and the expected gradient amax is ``max |c_use|`` (before
FP8 rounding), like ``max |x_use|`` for the input and ``max |w|`` for the kernel.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import jax_fp8
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral

RECIPE = jax_fp8.DelayedScaling(history_len=4)
D = 8


class Block(nn.Module):
    """One Dense used k times: xs [k, B, D] -> [k, B, D]."""
    k: int

    @nn.compact
    def __call__(self, xs):
        dense = nn.Dense(D, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=RECIPE))
        return jnp.stack([dense(xs[i]) for i in range(self.k)])


class Layer(nn.Module):
    """A scan body: (carry, xs) -> (carry, Block(xs)), optionally vmapped."""
    k: int
    vmapped: bool

    @nn.compact
    def __call__(self, carry, xs):
        return carry, make_block(self.k, self.vmapped)(xs)


def make_block(k, vmapped):
    block = Block
    if vmapped:  # over an example axis, the FP8 state shared (broadcast)
        block = nn.vmap(block, variable_axes={"params": None, FP8_COLLECTION: None},
                        split_rngs={"params": False}, in_axes=1, out_axes=1)
    return block(k)


class Stack(nn.Module):
    """`layers` Layers under nn.scan, one FP8 state per layer: xs [layers, ...]."""
    k: int
    vmapped: bool
    layers: int

    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(Layer, variable_axes={"params": 0, FP8_COLLECTION: 0},
                       split_rngs={"params": True}, length=self.layers, in_axes=0, out_axes=0)
        return scan(self.k, self.vmapped)(None, xs)[1]


def make_model(k, layers, vmapped):
    return Stack(k, vmapped, layers) if layers else make_block(k, vmapped)


def _staged(fp8_grads):
    return jax_fp8.amax_cotangents(fp8_grads)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 3), layers=st.sampled_from([0, 2]), vmapped=st.booleans(),
       micro=st.sampled_from([1, 2]), mutable=st.booleans(), jit=st.booleans(),
       seed=st.integers(0, 2**16))
def test_staged_amaxes_are_the_max_over_all_uses(k, layers, vmapped, micro, mutable, jit,
                                                 seed):
    rng = np.random.default_rng(seed)
    shape = (k, 2, 4, D) if vmapped else (k, 4, D)          # [k, (V,) B, D]
    if layers:
        shape = (layers,) + shape
    scales = rng.uniform(0.1, 10.0, size=shape[:len(shape) - 2] + (1, 1))
    x = jnp.asarray(rng.standard_normal(shape) * scales, jnp.float32)
    c = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.1, 10.0), jnp.float32)
    model = make_model(k, layers, vmapped)
    v = model.init(jax.random.key(seed), x)

    def loss(fp8, params, x, c):
        variables = {"params": params, FP8_COLLECTION: fp8}
        y = (model.apply(variables, x, mutable=[FP8_COLLECTION])[0] if mutable
             else model.apply(variables, x))
        return jnp.sum(y.astype(jnp.float32) * c)

    grad = jax.grad(loss)
    grad = jax.jit(grad) if jit else grad
    batch_axis = len(shape) - 2
    parts = np.array_split(np.arange(shape[batch_axis]), micro)
    grads = [grad(v[FP8_COLLECTION], v["params"], jnp.take(x, p, axis=batch_axis),
                  jnp.take(c, p, axis=batch_axis)) for p in parts]
    got = _staged(jax_fp8.combine_fp8_grads(*grads))

    lead = 1 if layers else 0        # per-layer amaxes keep the layer axis
    reduce_axes = tuple(range(lead, len(shape)))
    want_x = np.max(np.abs(np.asarray(x)), axis=reduce_axes)
    want_c = np.max(np.abs(np.asarray(c)), axis=reduce_axes)
    (kernel,) = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(v["params"])[0]
                 if jax.tree_util.keystr(path).endswith("['kernel']")]
    want_w = np.max(np.abs(np.asarray(kernel)), axis=tuple(range(lead, kernel.ndim)))

    (meta,) = [m for m in jax.tree.leaves(got, is_leaf=lambda m: isinstance(m, dict)
                                          and "input" in m)]
    np.testing.assert_array_equal(meta["input"], want_x)
    np.testing.assert_array_equal(meta["kernel"], want_w)
    # The gradient reaching each use is c exactly (the loss is linear in the outputs).
    np.testing.assert_array_equal(meta["grad"], want_c)
