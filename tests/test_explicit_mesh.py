"""FP8 backward on a mesh with Explicit axes: the gradient GEMMs contract over the
sharded batch axis, so they must name their output sharding (as JAX's own dot rule
does); the sharded gradients equal the single-device ones."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fp8_dot_general_grad_on_explicit_mesh():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "explicit_mesh_worker.py")],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(lines[-1][len("RESULTS "):])
    assert res["equal"], res
    assert res["specs"][1] in ("P('data', None)", "PartitionSpec('data', None)"), res  # dx like x
