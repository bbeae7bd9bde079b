"""FP8 data-parallel training across TWO processes (jax.distributed, gloo CPU collectives).

Two fresh interpreters (multiprocess_worker.py), each with one CPU device, join one
2-device mesh through a coordinator on a free localhost port. The batch is sharded over
the processes (each feeds its own shard; process 1's inputs are 3x larger), the params
and the FP8 state are replicated, and XLA inserts the collectives: the gradient
all-reduce (sum) and the all-reduce (max) of the observed amaxes, inside the compiled
step, followed by ONE fused jax_fp8_update. After 3 steps both processes must hold
bit-identical params and FP8 state, and the recorded amaxes must be the global ones.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multiprocess_worker.py")
PREFIX = "JAX_FP8_MULTIPROCESS "
NUM_PROCESSES = 2
TIMEOUT_S = 240


def _gloo_missing_reason():
    """Why gloo CPU collectives cannot be used with this jax, or None when they can."""
    from jax._src import config
    try:
        from jax._src.lib import _jax
    except ImportError:  # jaxlib before the rename of xla_extension
        from jax._src.lib import xla_extension as _jax

    option = getattr(config, "cpu_collectives_implementation", None)
    if option is None:
        return "this jax has no jax_cpu_collectives_implementation option"
    if not hasattr(_jax, "make_gloo_tcp_collectives"):
        return "this jaxlib was built without gloo CPU collectives (no make_gloo_tcp_collectives)"
    return None


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # One CPU device per process: drop any forced host device count.
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    # The coordinator is gRPC on localhost: never through a proxy (gRPC honours them).
    for key in [k for k in env if "_proxy" in k.lower()]:
        del env[key]
    return env


def _run_workers(tmp_path):
    """Starts every worker, waits for all (TIMEOUT_S in total), returns [(rc, out, err)].

    Output goes to files, not pipes: a worker blocked on a full pipe would stall its
    peer's collectives. Any worker still running at the end is killed."""
    port = _free_port()
    procs, files = [], []
    try:
        for pid in range(NUM_PROCESSES):
            out = open(tmp_path / f"worker{pid}.out", "w+")
            err = open(tmp_path / f"worker{pid}.err", "w+")
            files += [out, err]
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, str(port), str(pid), str(NUM_PROCESSES)],
                cwd=HERE, env=_worker_env(), stdout=out, stderr=err,
                stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + TIMEOUT_S
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    results = []
    for pid, p in enumerate(procs):
        out, err = files[2 * pid], files[2 * pid + 1]
        out.seek(0)
        err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
    for f in files:
        f.close()
    if timed_out:
        pytest.fail(f"workers did not finish within {TIMEOUT_S} s (killed):\n"
                    + _describe(results), pytrace=False)
    return results


def _describe(results):
    return "\n".join(f"--- worker {pid} rc={rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
                     for pid, (rc, out, err) in enumerate(results))


def _report(out):
    lines = [ln for ln in out.splitlines() if ln.startswith(PREFIX)]
    return json.loads(lines[-1][len(PREFIX):]) if lines else None


def test_two_process_fp8_data_parallel_training(tmp_path):
    reason = _gloo_missing_reason()
    if reason:
        pytest.skip(reason)
    results = _run_workers(tmp_path)
    assert all(rc == 0 for rc, _, _ in results), _describe(results)
    reports = [_report(out) for _, out, _ in results]
    assert all(r is not None for r in reports), _describe(results)
    r0, r1 = reports

    for pid, r in enumerate(reports):
        assert (r["process_id"], r["process_count"], r["device_count"],
                r["local_device_count"]) == (pid, 2, 2, 1), r
        # The compiled step: ONE fused FP8 update, and the collectives XLA inserted: a
        # sum for the gradients and a max for the amaxes of the sharded activations
        # and output gradients.
        assert r["custom_calls"] == 1, r
        assert r["all_reduce"] + r["all_reduce_start"] >= 2, r
        assert r["all_reduce_kinds"].get("add", 0) >= 1, r
        assert r["all_reduce_kinds"].get("maximum", 0) >= 1, r

    # Bit-identical replicas on both processes.
    assert r0["params_checksum"] == r1["params_checksum"], (r0, r1)
    assert r0["fp8_checksum"] == r1["fp8_checksum"], (r0, r1)
    assert r0["losses"] == r1["losses"], (r0["losses"], r1["losses"])
    assert r0["scales"] == r1["scales"]

    # The FP8 state was updated: it differs from the initial state, no scale is left at 1.
    assert r0["fp8_initial_checksum"] == r1["fp8_initial_checksum"]
    assert r0["fp8_checksum"] != r0["fp8_initial_checksum"]
    assert all(s != 1.0 for s in r0["scales"].values()), r0["scales"]

    # The first GEMM's input history records, per step, the GLOBAL amax: the max over
    # both processes' shards (process 1's, 3x larger), not process 0's own.
    global_amax = [max(a, b) for a, b in zip(r0["local_x_amax"], r1["local_x_amax"])]
    for r in reports:
        assert r["l1_input_history_head_zero"], r
        assert r["l1_input_history_tail"] == global_amax, (r["l1_input_history_tail"],
                                                           global_amax)
    assert all(a < g for a, g in zip(r0["local_x_amax"], global_amax)), (r0, global_amax)
