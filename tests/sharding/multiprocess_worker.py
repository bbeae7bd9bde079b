"""One of the two processes of test_multiprocess.py: FP8 data-parallel training across
processes, with the cross-process collectives done by gloo over TCP (CPU).

Usage: multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES (the test sets
JAX_PLATFORMS=cpu). Every process holds one CPU device; a global 1-D mesh over all of
them shards the batch on "data" and replicates the params, the optimizer state and the
FP8 state, so the compiled step contains the gradient all-reduce (sum) and the
all-reduce (max) of the observed amaxes, and ONE fused `jax_fp8_update` custom call
(`new_fp8_state`). Each process feeds its own data shard: process p draws inputs of
scale 1 + 2 p, so the global amax is never process 0's own.

At the end it prints one line, "JAX_FP8_MULTIPROCESS " + JSON: sha256 checksums of its
local copies of the params and of the FP8 state (exact bytes of every leaf), the number
of all-reduces and of jax_fp8_update custom calls in the compiled step, the losses, the
FP8 scales, and the amaxes it observed locally next to the recorded ones.
"""

from __future__ import annotations

import hashlib
import json
import sys

import jax

PORT, PROCESS_ID, NUM_PROCESSES = (int(a) for a in sys.argv[1:4])

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}",
                           num_processes=NUM_PROCESSES, process_id=PROCESS_ID,
                           coordinator_bind_address=f"127.0.0.1:{PORT}",
                           cluster_detection_method="deactivate",
                           initialization_timeout=60, shutdown_timeout_seconds=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fp8  # noqa: E402

TARGET = 'custom_call_target="jax_fp8_update"'
D_IN, D_HID, D_OUT = 32, 64, 16          # multiples of 16
LOCAL_BATCH, STEPS, HISTORY = 16, 3, 16
RECIPE = jax_fp8.DelayedScaling(history_len=HISTORY)
DN = (((1,), (0,)), ((), ()))            # [B, K] x [K, N] -> [B, N]

assert jax.process_count() == NUM_PROCESSES, jax.process_count()
assert jax.local_device_count() == 1, jax.local_devices()
assert jax.device_count() == NUM_PROCESSES, jax.devices()

# Auto axes (GSPMD): XLA inserts the collectives. jax.make_mesh defaults to Explicit axes
# in jax 0.10, under which the backward weight-gradient dot of fp8_dot_general (batch
# axis contracted and sharded) raises ShardingTypeError asking for an out_sharding.
mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices(),
                     axis_types=(jax.sharding.AxisType.Auto,))
REP = NamedSharding(mesh, P())
DATA = NamedSharding(mesh, P("data"))
GLOBAL_BATCH = LOCAL_BATCH * NUM_PROCESSES


def is_state(x):
    return isinstance(x, jax_fp8.ScalingState)


def replicated(tree):
    """The same host values on every process -> global, replicated arrays."""
    return jax.device_put(jax.tree.map(np.asarray, tree), REP)


def local_copy(x):
    """This process's copy of a replicated global array, as NumPy."""
    assert x.is_fully_replicated, x.sharding
    return np.asarray(x.addressable_shards[0].data)


def checksum(tree):
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = local_copy(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape};".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# Identical initial params (fixed seed) and fresh FP8 state on every process.
init = np.random.default_rng(0)
params = replicated({
    "w1": (init.standard_normal((D_IN, D_HID)) / np.sqrt(D_IN)).astype(np.float32),
    "b1": np.zeros((D_HID,), np.float32),
    "w2": (init.standard_normal((D_HID, D_OUT)) / np.sqrt(D_HID)).astype(np.float32),
    "b2": np.zeros((D_OUT,), np.float32),
})
fp8 = replicated({"l1": jax_fp8.Fp8Meta.create(RECIPE), "l2": jax_fp8.Fp8Meta.create(RECIPE)})
fp8_initial = checksum(fp8)
tx = optax.adamw(1e-2)
opt_state = jax.jit(tx.init, out_shardings=REP)(params)


def loss_fn(params, fp8, x, y):
    h, _ = jax_fp8.fp8_dot_general(x, params["w1"], DN, fp8["l1"])
    h = jax.nn.gelu(h + params["b1"])
    out, _ = jax_fp8.fp8_dot_general(h, params["w2"], DN, fp8["l2"])
    return jnp.mean((out + params["b2"] - y) ** 2)


def train_step(params, opt_state, fp8, x, y):
    loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, fp8, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    fp8 = jax_fp8.new_fp8_state(fp8, fp8_grads, RECIPE)   # ONE update_states call
    return params, opt_state, fp8, loss


# all_reduce_kinds: {"add": n, "maximum": m, ...} of an HLO text.
from jax_fp8.devtools.hlo import all_reduce_kinds  # noqa: E402


def batch(step):
    """This process's shard of the step's global batch."""
    rng = np.random.default_rng(1000 * step + PROCESS_ID)
    x = (rng.standard_normal((LOCAL_BATCH, D_IN)) * (1 + 2 * PROCESS_ID)).astype(np.float32)
    y = rng.standard_normal((LOCAL_BATCH, D_OUT)).astype(np.float32)
    glob = [jax.make_array_from_process_local_data(DATA, a, (GLOBAL_BATCH,) + a.shape[1:])
            for a in (x, y)]
    return glob, float(np.max(np.abs(x)))


step = jax.jit(train_step, in_shardings=(REP, REP, REP, DATA, DATA),
               out_shardings=(REP, REP, REP, REP))
(x0, y0), _ = batch(0)
compiled = step.lower(params, opt_state, fp8, x0, y0).compile()
hlo = compiled.as_text()

losses, local_x_amax = [], []
for i in range(STEPS):
    (x, y), amax = batch(i)
    local_x_amax.append(amax)
    params, opt_state, fp8, loss = compiled(params, opt_state, fp8, x, y)
    losses.append(float(local_copy(loss)))

scales = {jax.tree_util.keystr(p): local_copy(s.scale).tolist() for p, s in
          jax.tree_util.tree_flatten_with_path(fp8, is_leaf=is_state)[0]}
history = local_copy(fp8["l1"].input.amax_history)
report = {
    "process_id": jax.process_index(),
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "local_device_count": jax.local_device_count(),
    "params_checksum": checksum(params),
    "fp8_checksum": checksum(fp8),
    "fp8_initial_checksum": fp8_initial,
    "all_reduce": hlo.count(" all-reduce("),
    "all_reduce_start": hlo.count(" all-reduce-start("),
    "all_reduce_kinds": all_reduce_kinds(hlo),
    "custom_calls": hlo.count(TARGET),
    "losses": losses,
    "scales": scales,
    # With history_len 16, after STEPS updates the last STEPS slots hold each step's
    # recorded amax, oldest first; the staging slot and the rest are zero.
    "l1_input_history_tail": history[HISTORY - STEPS:].tolist(),
    "l1_input_history_head_zero": bool(np.all(history[:HISTORY - STEPS] == 0)),
    "local_x_amax": local_x_amax,
}
print("JAX_FP8_MULTIPROCESS " + json.dumps(report), flush=True)
jax.distributed.shutdown()
