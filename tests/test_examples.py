"""CPU smoke tests of the examples, run as a user runs them (subprocesses):

* examples/train_fp8_lm.py (the FP8 char-LM demo) with --compare: metrics.json with
  train and validation losses of both runs and their gap, the plots, and nothing written
  outside --out (cwd, HOME and TMPDIR stay empty);
* examples/convergence.py --preset smoke: two runs (bf16, jax_fp8_delayed) stopped after
  2 of 4 steps, resumed from their orbax checkpoints, and results.json's schema; a recipe
  the library refuses is skipped with a message (in-process); with --runslow, the resumed
  run equals an uninterrupted one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
COMMON = ["--preset", "smoke", "--layers", "1", "--steps", "4", "--ckpt-every", "2",
          "--eval-every", "2", "--probe-every", "2", "--log-every", "1",
          "--timing-warmup", "0"]


def _load(script):
    path = ROOT / "examples" / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod       # dataclasses (flax modules) look their module up
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.dont_write_bytecode = dont_write
    return mod


def _env(tmp_path: pathlib.Path, **extra) -> dict:
    home, tmp = tmp_path / "home", tmp_path / "tmpdir"
    home.mkdir(exist_ok=True)
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XDG_", "MPL", "JAX_COMPILATION_CACHE"))}
    # Less XLA:CPU optimization: these tests check the scripts' plumbing, and compiling
    # the train steps is most of their time.
    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env.update(JAX_PLATFORMS="cpu", HOME=str(home), TMPDIR=str(tmp),
               PYTHONDONTWRITEBYTECODE="1",
               XLA_FLAGS=(env.get("XLA_FLAGS", "") + " " + flags).strip(), **extra)
    return env


def _run(script, args, cwd, env, timeout=300):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert "\r" not in proc.stderr      # not a terminal: progress lines, no bar redraws
    return proc


def test_demo_smoke(tmp_path):
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    env = _env(tmp_path)
    proc = _run("train_fp8_lm.py",
                ["--steps", "4", "--out", str(out), "--d-model", "16", "--layers", "1",
                 "--heads", "2", "--seq-len", "16", "--batch", "4", "--history-len", "4",
                 "--eval-batches", "1", "--eval-every", "2", "--compare"], cwd, env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    saved = json.loads((out / "metrics.json").read_text())
    assert len(saved["loss"]) == 4 and len(saved["reference_loss"]) == 4
    assert all(math.isfinite(v) for v in saved["loss"] + saved["reference_loss"])
    assert saved["n_fp8_tensors"] == 4 * 3
    for key in ("valid_curve", "reference_valid_curve"):
        assert saved[key]["steps"] == [2, 4] and len(saved[key]["loss"]) == 2
    final = saved["final"]
    for run in ("fp8", "reference"):
        assert math.isfinite(final[run]["train_loss"]) and math.isfinite(final[run]["valid_loss"])
    ref = final["reference"]
    assert final["rel_gap"]["valid"] == pytest.approx(
        (final["fp8"]["valid_loss"] - ref["valid_loss"]) / ref["valid_loss"])
    assert final["fp8"]["valid_loss"] == saved["valid_curve"]["loss"][-1]
    assert all(len(s["amax"]) == 4 for s in saved["fp8_tracked"].values())
    # The end-of-run report: both runs' final train / validation losses and the gap.
    assert "relative gap" in proc.stdout and proc.stdout.count("valid ") >= 3, proc.stdout
    assert "[fp8] step 4/4" in proc.stderr and "[reference] step 4/4" in proc.stderr
    # Nothing outside --out; nothing but the results inside it.
    expected = {"metrics.json"} | ({"loss.png", "fp8_scaling.png"} if HAS_MPL else set())
    assert {p.name for p in out.iterdir()} == expected
    for d in ("cwd", "home", "tmpdir"):
        assert not list((tmp_path / d).iterdir()), d


def _cached_env(tmp_path):
    # (Test-only: a compilation cache under tmp_path shares compiles between processes.)
    return _env(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _stop_and_resume(tmp_path, runs, out):
    """Process 1 stops after 2 of 4 steps (as --max-minutes does); process 2 resumes."""
    env, cwd = _cached_env(tmp_path), tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    p = _run("convergence.py", COMMON + runs + ["--out", str(out), "--stop-after", "2",
                                                "--exit-code-unfinished", "3", "--no-plot"],
             cwd, env)
    assert p.returncode == 3, p.stderr[-5000:]
    first = json.loads((out / "results.json").read_text())
    p2 = _run("convergence.py", COMMON + runs + ["--out", str(out), "--resume"], cwd, env)
    assert p2.returncode == 0, p2.stderr[-5000:]
    return first, p2


def test_convergence_smoke_checkpoint_resume(tmp_path):
    env, cwd = _cached_env(tmp_path), tmp_path / "cwd"
    cwd.mkdir()
    out = tmp_path / "conv"
    common, runs = COMMON, ["--runs", "bf16,jax_fp8_delayed"]

    # 1. Stop after 2 steps (as --max-minutes does): checkpointed, unfinished (status 3).
    p = _run("convergence.py", common + runs + ["--out", str(out), "--stop-after", "2",
                                                "--exit-code-unfinished", "3", "--no-plot"],
             cwd, env)
    assert p.returncode == 3, p.stderr[-5000:]
    first = json.loads((out / "results.json").read_text())
    for name in ("bf16", "jax_fp8_delayed"):
        r = first["runs"][name]
        assert not r["complete"] and r["steps_done"] == 2 and len(r["train_loss"]) == 2
        assert r["final_val_loss"] is None
        assert (out / name / "ckpt" / "2").is_dir()
    # Without --resume an existing checkpoint is an error, not overwritten.
    p = _run("convergence.py", common + runs + ["--out", str(out)], cwd, env)
    assert p.returncode != 0 and "--resume" in p.stderr

    # 2. Resume: both runs continue from step 2 to the end.
    p = _run("convergence.py", common + runs + ["--out", str(out), "--resume"], cwd, env)
    assert p.returncode == 0, p.stderr[-5000:]
    assert "resumed from" in p.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["steps"] == 4 and res["params"] > 0 and res["device"]
    assert res["tokens_per_step"] == 4 * 64
    assert res["data"]["files_train"] > 0 and res["data"]["files_val"] > 0
    assert set(res["runs"]) == {"bf16", "jax_fp8_delayed"} and not res["skipped"]
    for name in ("bf16", "jax_fp8_delayed"):
        r = res["runs"][name]
        assert r["complete"] and r["steps_done"] == 4
        assert len(r["train_loss"]) == 4 and all(math.isfinite(v) for v in r["train_loss"])
        assert r["val_steps"] == [0, 2, 4] and len(r["val_loss"]) == 3
        assert r["final_val_loss"] == r["val_loss"][-1] and math.isfinite(r["final_val_loss"])
        assert r["tokens_per_s"] > 0
        assert [q["start_step"] for q in r["processes"]] == [0, 2]
        und = r["e5m2_underflow"]
        assert und["steps"] == [0, 2] and len(und["layers"]) == 4
        for series in und["layers"].values():
            assert all(0 <= v <= 1 for v in series["current_scale"])
            own = series["run_scale"]
            if name == "bf16":
                assert own == [None, None]
            else:
                assert all(0 <= v <= 1 for v in own)
    fp8 = res["runs"]["jax_fp8_delayed"]
    assert len(fp8["fp8_tracked"]) == 6
    for series in fp8["fp8_tracked"].values():
        assert len(series["amax"]) == len(series["scale"]) == 4
        assert all(v > 0 for v in series["scale"])
    if HAS_MPL:
        assert (out / "loss.png").is_file() and (out / "fp8.png").is_file()
    assert not list(cwd.iterdir()) and not list((tmp_path / "home").iterdir())



@pytest.mark.slow
def test_convergence_resumed_run_equals_uninterrupted(tmp_path):
    _, p = _stop_and_resume(tmp_path, ["--runs", "jax_fp8_delayed"], tmp_path / "resumed")
    cwd, env = tmp_path / "cwd", _cached_env(tmp_path)
    p = _run("convergence.py", COMMON + ["--runs", "jax_fp8_delayed", "--no-plot", "--out",
                                         str(tmp_path / "straight")], cwd, env)
    assert p.returncode == 0, p.stderr[-5000:]
    a, b = (json.loads((tmp_path / d / "results.json").read_text())["runs"]["jax_fp8_delayed"]
            for d in ("straight", "resumed"))
    # Same batches, same initial weights, restored optimizer and FP8 state: bit for bit.
    for key in ("train_loss", "val_loss", "grad_norm", "fp8_tracked", "e5m2_underflow"):
        assert a[key] == b[key], key


def test_convergence_skips_a_recipe_the_library_refuses(tmp_path, monkeypatch):
    conv = _load("convergence.py")
    # A recipe that this jax_fp8 does not have, and an object its layers refuse as one.
    monkeypatch.setitem(conv.RUNS, "missing", conv.RunSpec(
        "jax_fp8", "not in jax_fp8", conv._recipe("Float8NoSuchScaling")))
    monkeypatch.setitem(conv.RUNS, "refused", conv.RunSpec(
        "jax_fp8", "not a recipe", lambda cfg: object()))
    out = tmp_path / "out"
    res = conv.main(COMMON + ["--runs", "missing,refused", "--out", str(out), "--no-plot"])
    assert res["runs"] == {} and set(res["skipped"]) == {"missing", "refused"}
    assert "Float8NoSuchScaling" in res["skipped"]["missing"]
    assert all("does not accept" in why for why in res["skipped"].values())
    assert json.loads((out / "results.json").read_text())["skipped"] == res["skipped"]
