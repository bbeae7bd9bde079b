"""A small NNX model with FP8 layers, shared by the NNX tests of tests/flax_models/ and
sharding/pmap_worker.py."""

from flax import nnx

from jax_fp8.flax import nnx as fnnx


class Fp8Mlp(nnx.Module):
    """x [B, sizes[0]] -> l2(relu(l1(x))) [B, sizes[2]], l1 and l2 `fnnx.Fp8Linear` layers of
    `recipe` (sizes[0] -> sizes[1] -> sizes[2]), their parameters drawn from `rngs`."""

    def __init__(self, rngs, *, recipe, sizes=(8, 16, 4)):
        d_in, d_hidden, d_out = sizes
        self.l1 = fnnx.Fp8Linear(d_in, d_hidden, recipe=recipe, rngs=rngs)
        self.l2 = fnnx.Fp8Linear(d_hidden, d_out, recipe=recipe, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))
