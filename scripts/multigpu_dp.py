"""Data-parallel FP8 training over every local device (GPUs, or host CPUs with
--xla_force_host_platform_device_count): replicas must agree bit for bit, and the
step's amaxes must cross devices in one all-reduce.

  python scripts/multigpu_dp.py [--layers 8 --d 1024 --batch 8192 --steps 20] [--trace]

Reports: devices, step time (median), all-reduces in the compiled step by reduction
op (the gradient sum and the amax max), the jax_fp8_update count, and whether every
replicated leaf is bit-identical on every device. With --trace on GPUs, the GPU time
of the collective kernels per step (profiler trace).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8
from jax_fp8.devtools import hlo as hlo_tools
from jax_fp8.devtools import trace

DN = (((1,), (0,)), ((), ()))


def collective_gpu_us(step, args, reps, ops=None):
    """µs of collective kernels per step and device, from a profiler trace (``ops``:
    the compiled step's `hlo.op_families`)."""
    args, events = trace.capture(lambda a: step(*a), args, steps=reps)
    families = trace.by_family(trace.device_events(events), ops)
    coll_us = sum(us for family, us in families.items() if family.startswith("collective"))
    return coll_us / reps / jax.local_device_count(), args


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8192, help="global batch (rows)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices, axis_types=(AxisType.Auto,))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    recipe = jax_fp8.DelayedScaling(history_len=16)
    dtype = jnp.bfloat16 if devices[0].platform == "gpu" else jnp.float32
    rng = np.random.default_rng(0)
    params = jax.device_put([(rng.standard_normal((args.d, args.d)) / np.sqrt(args.d)).astype(np.float32)
                             for _ in range(args.layers)], rep)
    fp8 = jax.device_put([jax_fp8.Fp8Meta.create(recipe) for _ in range(args.layers)], rep)
    tx = optax.adam(1e-3)
    opt_state = jax.jit(tx.init, out_shardings=rep)(params)

    def loss_fn(params, fp8, x, y):
        h = x.astype(dtype)
        for w, m in zip(params, fp8):
            h, _ = jax_fp8.fp8_dot_general(h, w.astype(dtype), DN, m)
            h = jax.nn.gelu(h)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    def step(params, opt_state, fp8, x, y):
        grads, fp8_grads = jax.grad(loss_fn, argnums=(0, 1))(params, fp8, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state,
                jax_fp8.new_fp8_state(fp8, fp8_grads, recipe), x, y)

    x = jax.device_put(rng.standard_normal((args.batch, args.d)).astype(np.float32), data)
    y = jax.device_put(rng.standard_normal((args.batch, args.d)).astype(np.float32) * 0.1, data)
    step = jax.jit(step, donate_argnums=(0, 1, 2))
    t0 = time.time()
    compiled = step.lower(params, opt_state, fp8, x, y).compile()
    compile_s = time.time() - t0
    hlo = compiled.as_text()
    state = (params, opt_state, fp8, x, y)
    state = compiled(*state)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state = compiled(*state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    coll_us = None
    if args.trace and devices[0].platform == "gpu":
        coll_us, state = collective_gpu_us(compiled, state, 5, hlo_tools.op_families(hlo))
    params, opt_state, fp8 = state[:3]
    agree = True
    for leaf in jax.tree.leaves((params, fp8)):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        agree &= all(shards[0].tobytes() == s.tobytes() for s in shards[1:])
    report = {
        "devices": f"{len(devices)} x {devices[0].device_kind}", "jax": jax.__version__,
        "layers": args.layers, "d": args.d, "global_batch": args.batch,
        "compile_s": round(compile_s, 2), "step_ms_median": round(1e3 * float(np.median(times)), 3),
        "all_reduces": hlo_tools.all_reduce_kinds(hlo),
        "collectives": [c._asdict() for c in hlo_tools.collectives(hlo)],
        "jax_fp8_update_calls": hlo_tools.count_custom_calls(hlo, "jax_fp8_update"),
        "replicas_bit_identical": bool(agree),
        "collective_gpu_us_per_step_per_device": coll_us,
        "scales_not_one": int(sum(int(np.sum(np.asarray(s) != 1)) for s in jax.tree.leaves(
            jax.tree.map(lambda st: st.scale, fp8, is_leaf=lambda z: isinstance(z, jax_fp8.ScalingState))))),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
