"""Is the update inside a CUDA graph? Evidence from the profiler trace (run on a GPU).

jax 0.11's XLA forms command buffers (CUDA graphs) from the thunk sequence after code
generation, so the HLO text no longer shows `command_buffer` computations. This runs
the step of tests/test_long_run.py::test_update_runs_inside_a_cuda_graph (the update
between a GEMM and elementwise work, command buffers on with the smallest graph size
1) under the profiler and prints what the trace says about how its kernels were
launched: the host-side launch events (cudaGraphLaunch / cuGraphLaunch against
cudaLaunchKernel) and the arguments recorded with the update kernel's event.

    python scripts/cuda_graph_check.py [--reps N]
"""

import argparse
import collections
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

import jax_fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bench_update  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    gpu = jax.devices("gpu")[0]
    tree = [jax_fp8.ScalingState.create((4,), 16 * (i + 1)) for i in range(6)]
    amaxes = [jnp.full((4,), 3.0) for _ in tree]

    def step(states, amaxes, x):
        y = jnp.tanh(x @ x) + 1.0
        return jax_fp8.update_states(states, amaxes), (y * 2.0).sum(), jnp.exp(x).max()

    x = jnp.ones((64, 64))
    args_dev = jax.device_put((tree, amaxes, x), gpu)
    compiled = jax.jit(step).lower(*args_dev).compile(
        compiler_options={"xla_gpu_graph_min_graph_size": 1})
    print("HLO has command_buffer computations:", "command_buffer" in compiled.as_text())
    st = args_dev[0]
    for _ in range(3):  # the first runs instantiate the graphs
        st, _, _ = compiled(st, args_dev[1], args_dev[2])
    jax.block_until_ready(st)
    logdir = tempfile.mkdtemp()
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(args.reps):
            st, _, _ = compiled(st, args_dev[1], args_dev[2])
        jax.block_until_ready(st)
    events = bench_update.load_trace_events(logdir)
    launches = collections.Counter()
    update_args = []
    for e in events:
        name = str(e.get("name", ""))
        if "Graph" in name and ("Launch" in name or "launch" in name):
            launches[name] += 1
        elif name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaLaunchKernelExC"):
            launches[name] += 1
        if "UpdateKernel" in name and e.get("ph") == "X" and len(update_args) < 2:
            update_args.append(e.get("args", {}))
    print(f"host launch events over {args.reps} steps:", dict(launches))
    print("update kernel event args:", update_args)
    kernels = bench_update.traced_kernels(logdir, "gpu")
    print("kernels per step:", {k[:60]: v[0] / args.reps for k, v in kernels.items()})


if __name__ == "__main__":
    main()
