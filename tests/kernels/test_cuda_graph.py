"""GPU: the fused update runs inside a CUDA graph, read from a profiler trace.

XLA records command buffers (CUDA graphs) from its thunks after code generation, so the
compiled HLO may not show them; the trace does: the update kernel's launch is a graph
launch (the kernel event's ``correlation_id`` is that of a ``cuGraphLaunch`` host event)
rather than a kernel launch of its own. (test_long_run.py checks the bits of such
replays.)"""

import jax
import jax.numpy as jnp
import pytest

import jax_fp8
from jax_fp8.devtools import hlo, trace

REPS = 20


def _correlation(event):
    return (event.get("args") or {}).get("correlation_id")


@pytest.mark.gpu
def test_update_kernel_is_launched_in_a_cuda_graph(gpu_device):
    tree = [jax_fp8.ScalingState.create((4,), 16 * (i + 1)) for i in range(6)]
    amaxes = [jnp.full((4,), 3.0) for _ in tree]

    def step(states, amaxes, x):  # the update between a GEMM and elementwise work
        y = jnp.tanh(x @ x) + 1.0
        return jax_fp8.update_states(states, amaxes), (y * 2.0).sum(), jnp.exp(x).max()

    args = jax.device_put((tree, amaxes, jnp.ones((64, 64))), gpu_device)
    compiled = jax.jit(step).lower(*args).compile(
        compiler_options={"xla_gpu_graph_min_graph_size": 1})
    assert hlo.count_custom_calls(compiled, "jax_fp8_update") == 1
    states, amaxes, x = args
    for _ in range(3):  # the first runs record and instantiate the graphs
        states = compiled(states, amaxes, x)[0]
    jax.block_until_ready(states)
    states, events = trace.capture(lambda s: compiled(s, amaxes, x)[0], states, steps=REPS)

    updates = [e for e in trace.device_events(events, "gpu") if "UpdateKernel" in e["name"]]
    assert len(updates) == REPS, trace.by_name(trace.device_events(events, "gpu"))
    graph_launches = [e for e in events if e.get("ph") == "X"
                      and "GraphLaunch" in str(e.get("name", ""))]
    assert len(graph_launches) >= REPS, sorted({str(e.get("name")) for e in events
                                                if "aunch" in str(e.get("name", ""))})
    graph_ids = {_correlation(e) for e in graph_launches} - {None}
    update_ids = {_correlation(e) for e in updates} - {None}
    if graph_ids and update_ids:  # the trace links each kernel to its host launch
        assert update_ids <= graph_ids, (update_ids - graph_ids, graph_launches[:2])
    else:  # no links recorded: then no kernel was launched on its own
        plain = [e for e in events if e.get("ph") == "X" and e.get("name") in (
            "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")]
        assert not plain, plain[:3]
