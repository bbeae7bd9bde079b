"""CPU smoke tests of bench/bench_update.py, bench/bench_layout_kernels.py and bench/plot.py:
tiny configurations, each script in a subprocess as a user runs it (seconds each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jax_fp8

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository
COLUMNS = ("per_tensor_jnp", "stacked_jnp", "fused_pytree", "fused_stacked", "floor")


def run_script(*args, timeout=240):
    """Runs `python bench/<script> args` on CPU from the repository root; returns the process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "\r" not in proc.stderr          # a log gets lines, never carriage returns
    return proc


def test_bench_update_tiny_run(tmp_path):
    out = tmp_path / "update"
    proc = run_script("bench/bench_update.py", "--sizes", "2,3", "--lengths", "8",
                      "--warmup", "1", "--min-calls", "1", "--max-calls", "2",
                      "--wall-seconds", "0", "--trace-reps", "2",
                      "--per-tensor-max-n", "2", "--outdir", str(out))
    data = json.loads((out / "results.json").read_text())
    rows = {(r["n"], r["column"]): r for r in data["results"]}
    # --per-tensor-max-n 2 skips both per-tensor layouts at N = 3; the rest ran.
    assert set(rows) == {(n, c) for n in (2, 3) for c in COLUMNS
                         if n == 2 or c not in ("per_tensor_jnp", "fused_pytree")}
    assert [s["column"] for s in data["skipped"]] == ["per_tensor_jnp", "fused_pytree"]
    assert not data["failures"]
    assert rows[(2, "per_tensor_jnp")]["kernels_hlo"] > rows[(2, "stacked_jnp")]["kernels_hlo"]
    if jax_fp8.HAS_CPU_KERNEL:  # the fused update is one custom call whatever the layout
        assert rows[(2, "fused_pytree")]["kernels_hlo"] == 1
        assert rows[(3, "fused_stacked")]["kernels_hlo"] == 1
    for r in rows.values():
        assert r["wall_us_median"] > 0 and r["device_us"] >= 0 and r["compile_s"] >= 0
    assert data["launch_floor"]["kernels_hlo"] >= 1
    assert data["ratios"][0]["wall_us_median:per_tensor_jnp/fused_pytree"] > 0
    md = (out / "results.md").read_text()
    assert md.strip() in proc.stdout
    assert ("| N | L | per-tensor jnp | stacked jnp | fused pytree | fused stacked | copy floor |"
            in md)
    assert "| 3 | 8 | — |" in md and "Skipped (— above): per_tensor_jnp at N=3 L=8" in md
    assert "CPU op time per update" in md and "Launch floor" in md
    assert "[8/8] N=3 L=8 floor" in proc.stderr      # one line per column measured
    if _has_matplotlib():
        assert (out / "bench_update.png").stat().st_size > 1000


def test_bench_layout_kernels_quick(tmp_path):
    out = tmp_path / "layout.json"
    proc = run_script("bench/bench_layout_kernels.py", "--quick", "--reps", "2", "--json",
                      str(out))
    assert "| 132x260 |" in proc.stdout and "Quantize (E5M2" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["shape"] for r in data["transpose"]] == [[128, 256], [132, 260]]
    # (On the CPU the time comes from the profiler's XLA op events: >= 0 where a jax
    # version's CPU profiler writes none.)
    assert data["quantize_transpose"][0]["jax_fp8 kernel"]["us"] >= 0


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_plot_script_draws_a_results_json(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "results.json"
    src.write_text(json.dumps({
        "meta": {"device": "NVIDIA H200", "platform": "gpu", "jax_version": "0"},
        "results": [{"n": n, "l": 1024, "column": c, "device_us": us * n, "wall_us_median": 9.0}
                    for n in (3, 1152) for c, us in zip(COLUMNS, (5.0, 0.1, 0.01, 0.01, 0.01))],
        "launch_floor": {"device_us": 1.1}}))
    run_script("bench/plot.py", str(src), "--png", str(tmp_path / "u.png"))
    assert (tmp_path / "u.png").stat().st_size > 1000
