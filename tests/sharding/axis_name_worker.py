"""update_states(..., axis_name=...) under shard_map on 8 host devices (run by
test_axis_name.py in a fresh process). Prints one JSON line of results."""

import json

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

# A data-parallel FP8 train step written with shard_map(check_vma=False): the FP8 ops'
# backward max-reduces the amaxes over the mapped axis, new_fp8_state(axis_name=...) takes
# their max once more with one pmax. The result must equal the same step on one device
# over the whole batch.
DN = (((1,), (0,)), ((), ()))
recipe = jax_fp8.DelayedScaling(history_len=8)
ws = [jnp.asarray((rng.random((32, 32)) - 0.5) / 4, jnp.float32) for _ in range(3)]
metas = [jax_fp8.Fp8Meta.create(recipe) for _ in ws]
xb_np = rng.standard_normal((64, 32)).astype(np.float32)
xb = jax.device_put(xb_np, jax.sharding.NamedSharding(mesh, P("data")))


def loss(ws, metas, x):
    h = x
    for w, m in zip(ws, metas):
        h, _ = jax_fp8.fp8_dot_general(h, w, DN, m)
    return jnp.sum(h ** 2) / xb.shape[0]  # the global batch: local grads are slices


def dp_step(ws, metas, x):
    _, mg = jax.grad(loss, argnums=(0, 1))(ws, metas, x)
    return jax_fp8.new_fp8_state(metas, mg, recipe, axis_name="data")


dp = jax.jit(jax.shard_map(dp_step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(),
                           check_vma=False))
dp_hlo = dp.lower(ws, metas, xb).compile().as_text()
got = dp(ws, metas, xb)
ref = jax.jit(lambda w, m, x: jax_fp8.new_fp8_state(
    m, jax.grad(loss, argnums=1)(w, m, x), recipe))(ws, metas, jnp.asarray(xb_np))
dp_same = all(np.array_equal(np.asarray(a), np.asarray(b))
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))

# The same step with shard_map's default check_vma=True and no collective in user code:
# fp8_dot_general's backward sums the replicated weight's gradient over "data" (as
# JAX's own dot does) and max-reduces the amaxes, so the FP8 state needs no axis_name.
def vma_step(ws, metas, x):
    gw, mg = jax.grad(loss, argnums=(0, 1))(ws, metas, x)
    return gw, jax_fp8.new_fp8_state(metas, mg, recipe)


vma = jax.jit(jax.shard_map(vma_step, mesh=mesh, in_specs=(P(), P(), P("data")),
                            out_specs=(P(), P())))
vma_gw, vma_fp8 = vma(ws, metas, xb)
ref_gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(ws, metas, jnp.asarray(xb_np))[0]
vma_same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(vma_fp8), jax.tree.leaves(ref)))
vma_gw_close = all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
                   for a, b in zip(vma_gw, ref_gw))
print("RESULTS " + json.dumps({
    "vma_fp8_equal": vma_same, "vma_weight_grads_close": vma_gw_close,
    "all_reduce": hlo.count("all-reduce("), "all_reduce_start": hlo.count("all-reduce-start("),
    "custom_calls": hlo.count('custom_call_target="jax_fp8_update"'), "equal": same,
    "dp_all_reduce": dp_hlo.count("all-reduce(") + dp_hlo.count("all-reduce-start("),
    "dp_custom_calls": dp_hlo.count('custom_call_target="jax_fp8_update"'),
    "dp_equal": dp_same,
    "dp_amaxes_nonzero": all(float(np.asarray(st.amax_history)[-1]) > 0 for m in ref
                             for st in (m.input, m.kernel, m.grad))}))
