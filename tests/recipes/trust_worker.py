"""Multi-device checks of test_trust.py on 8 host devices (run in a fresh process):
shard_map's replication check sees the update's varying amax, the staged amaxes are
reduced under pmap without explicit amaxes, and sharded programs export. Prints one
"RESULTS <json>" line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fp8

assert jax.device_count() == 8
mesh = jax.make_mesh((8,), ("x",), devices=jax.devices())
out = {}

# shard_map with check_vma (the default): an update driven by a per-device amax varies
# over "x", so out_specs=P() must be refused by JAX's own check ...
st = jax_fp8.ScalingState.create((), 4)
a = jax.device_put(jnp.arange(1.0, 9.0), NamedSharding(mesh, P("x")))
bad = jax.jit(jax.shard_map(lambda st, a: jax_fp8.update_states(st, a[0]), mesh=mesh,
                            in_specs=(P(), P("x")), out_specs=P()))
try:
    bad(st, a)
    out["vma_error"] = None
except ValueError as err:
    out["vma_error"] = str(err)
# ... and with axis_name the amaxes are reduced first: replicated, the global max.
good = jax.jit(jax.shard_map(lambda st, a: jax_fp8.update_states(st, a[0], axis_name="x"),
                             mesh=mesh, in_specs=(P(), P("x")), out_specs=P()))
out["vma_reduced_scale"] = float(good(st, a).scale)
# compute_amax inside shard_map: a per-device value (varies over "x").
amax_bad = jax.jit(jax.shard_map(lambda x: jax_fp8.compute_amax(x), mesh=mesh,
                                 in_specs=P("x"), out_specs=P()))
try:
    amax_bad(a)
    out["amax_vma_error"] = None
except ValueError as err:
    out["amax_vma_error"] = str(err)

# pmap, amaxes staged in slot 0, no explicit amaxes: axis_name reduces the staged slots.
hist = jnp.zeros((4, 4)).at[:, 0].set(jnp.array([1.0, 2.0, 4.0, 8.0]))
stacked = jax_fp8.ScalingState(hist, jnp.ones(4), jnp.ones(4))
res = jax.pmap(lambda s: jax_fp8.update_states(s, None, axis_name="i"), axis_name="i",
               devices=jax.devices()[:4])(stacked)
out["pmap_scales"] = [float(s) for s in res.scale]
out["pmap_newest"] = [float(h) for h in res.amax_history[:, -1]]

# A sharded jit exports (no custom_partitioning callback in the serialized program),
# deserializes and runs with the bits of the jitted original.
state = jax.device_put(jax_fp8.ScalingState.create((16,), 8), NamedSharding(mesh, P("x")))
amax = jax.device_put(jnp.arange(1.0, 17.0), NamedSharding(mesh, P("x")))
f = jax.jit(jax_fp8.update_states)
exp = jax.export.export(f, disabled_checks=jax_fp8.export_disabled_checks())(state, amax)
back = jax.export.deserialize(exp.serialize())
out["export_update_same_bits"] = all(
    np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(back.call(state, amax)), jax.tree.leaves(f(state, amax))))
out["export_update_custom_calls"] = back.mlir_module().count("jax_fp8_update")

x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32),
                   NamedSharding(mesh, P("x")))
w = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32)
meta = jax_fp8.Fp8Meta.create(jax_fp8.DelayedScaling(history_len=4))


def step(x, w, meta):
    def loss(x, w, meta):
        return jnp.sum(jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta)[0] ** 2)
    gw, gm = jax.grad(loss, argnums=(1, 2))(x, w, meta)
    return gw, jax_fp8.new_fp8_state(meta, gm, jax_fp8.DelayedScaling(history_len=4))


want = jax.jit(step)(x, w, meta)
exp = jax.export.export(jax.jit(step), disabled_checks=jax_fp8.export_disabled_checks())(
    x, w, meta)
got = jax.export.deserialize(exp.serialize()).call(x, w, meta)
out["export_step_same_bits"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
print("RESULTS " + json.dumps(out))
