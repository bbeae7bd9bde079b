"""The CUDA launcher's planning, checked on the host (no GPU): offset width and launches
per call, including a call whose amaxes lie more than 16 GB from its states (a large
model's train step), which must stay one launch. Needs nvcc; skipped without it."""

import os
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_launch_planning(tmp_path):
    exe = str(tmp_path / "launch_plan_check")
    build = subprocess.run(["nvcc", "-std=c++17", "-o", exe,
                            os.path.join(HERE, "cuda", "launch_plan_check.cu")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr
