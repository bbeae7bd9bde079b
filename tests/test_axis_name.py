"""update_states(axis_name=...): amaxes of the whole tree cross devices in ONE
all-reduce (max), then one fused update; every replica ends with the same state."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_axis_name_one_collective_and_global_max():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "axis_name_worker.py")], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(lines[-1][len("RESULTS "):])
    assert res["all_reduce"] + res["all_reduce_start"] == 1, res
    assert res["custom_calls"] == 1, res
    assert res["equal"], res
