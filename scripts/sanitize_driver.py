"""Drives the CUDA kernel through the real JAX path for compute-sanitizer.

Covers: a donated (aliased, in-place) per-tensor pytree, a stacked state, mixed
history lengths (1 .. 5000, several passes per block), skip_unused, amax inputs, and
1,500 states in one call (two launches past the kernel-parameter limit).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8

rng = np.random.default_rng(0)
lengths = [1, 2, 3, 16, 1023, 1024, 1025, 5000]
tree = [jax_fp8.ScalingState(jnp.asarray(rng.random((i % 3, L), np.float32)),
                             jnp.ones((i % 3,), jnp.float32), jnp.ones((i % 3,), jnp.float32),
                             jnp.float8_e5m2 if i % 2 else jnp.float8_e4m3fn)
        for i, L in enumerate(lengths * 3)]
amaxes = [jnp.asarray(rng.random(st.scale.shape, np.float32)) for st in tree]
for skip in (False, True):
    recipe = jax_fp8.DelayedScaling(skip_unused=skip)
    step = jax.jit(lambda t, a: jax_fp8.update_states(t, a, recipe=recipe), donate_argnums=0)
    for _ in range(3):
        tree = step(tree, amaxes)
big = [jax_fp8.ScalingState.create((), 16) for _ in range(1500)]
big = jax.jit(jax_fp8.update_states, donate_argnums=0)(big)
stacked = jax_fp8.ScalingState.create((64,), 1024)
stacked = jax.jit(jax_fp8.update_states, donate_argnums=0)(stacked)
jax.block_until_ready((tree, big, stacked))
print("sanitize driver done")
