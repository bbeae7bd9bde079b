"""update_states(..., axis_name=...) under shard_map on 8 host devices (run by
test_axis_name.py in a fresh process). Prints one JSON line of results."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_fp8

assert jax.device_count() == 8
mesh = jax.make_mesh((8,), ("data",), devices=jax.devices())
rng = np.random.default_rng(0)
tree = {"x": jax_fp8.ScalingState.create((), 16),
        "w": jax_fp8.ScalingState.create((3,), 4, jnp.float8_e4m3fn),
        "g": jax_fp8.ScalingState.create((2, 2), 8, jnp.float8_e5m2)}
# Per-device amaxes: a leading device axis of 8, sharded over "data".
local = {"x": rng.random((8,), np.float32) * 10, "w": rng.random((8, 3), np.float32),
         "g": rng.random((8, 2, 2), np.float32)}
local["w"][3, 1] = np.nan  # a NaN on one device is ignored, not spread
local_np = local
local = jax.device_put(local, jax.sharding.NamedSharding(mesh, P("data")))


def step(tree, amaxes):
    amaxes = jax.tree.map(lambda a: a[0], amaxes)  # this device's amaxes
    return jax_fp8.update_states(tree, amaxes, axis_name="data")


f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                          check_vma=False))
hlo = f.lower(tree, local).compile().as_text()
out = f(tree, local)
global_amax = jax.tree.map(lambda a: np.fmax.reduce(a, axis=0), local_np)
want = jax.jit(lambda t, a: jax_fp8.update_states(t, a))(tree, global_amax)
same = all(np.array_equal(np.asarray(a), np.asarray(b))
           for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)))
print("RESULTS " + json.dumps({
    "all_reduce": hlo.count("all-reduce("), "all_reduce_start": hlo.count("all-reduce-start("),
    "custom_calls": hlo.count('custom_call_target="jax_fp8_update"'), "equal": same}))
