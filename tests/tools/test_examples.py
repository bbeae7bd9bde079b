"""CPU smoke tests of the examples, run as a user runs them (subprocesses):

* examples/train_fp8_lm.py (the FP8 char-LM demo) with --compare: metrics.json with
  train and validation losses of both runs and their gap, the plots, and nothing written
  outside --out (cwd, HOME and TMPDIR stay empty);
* examples/train_fp8_nnx.py (an NNX model converted to FP8 in one call): a few steps of
  delayed and blockwise scaling, metrics.json with the converted layers;
* examples/convergence.py --preset smoke: two runs (bf16, jax_fp8_delayed) of seed 0
  stopped after 2 of 4 steps, then seeds 0 and 1 (seed 0 resumed from its orbax
  checkpoints), the per-(run, seed) result files, finished runs skipped, --summarize's
  results.json, tables and doc block; the summary's statistics and the learning-rate
  schedule (in-process); a recipe the library refuses is skipped with a message; with
  --runslow, the resumed run equals an uninterrupted one.
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

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
HAS_MPL = importlib.util.find_spec("matplotlib") is not None
COMMON = ["--preset", "smoke", "--layers", "1", "--steps", "4", "--ckpt-every", "2",
          "--eval-every", "2", "--probe-every", "2", "--log-every", "1",
          "--timing-warmup", "0"]


def _load(script):
    """An example script loaded as a module (its sibling modules importable, as when run)."""
    path = ROOT / "examples" / script
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
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


@pytest.mark.parametrize("recipe", ["delayed", "block"])
def test_nnx_demo_smoke(tmp_path, recipe):
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    proc = _run("train_fp8_nnx.py",
                ["--steps", "3", "--out", str(out), "--recipe", recipe, "--d-model", "16",
                 "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4",
                 "--history-len", "4", "--eval-batches", "1"], cwd, _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-5000:]
    saved = json.loads((out / "metrics.json").read_text())
    assert len(saved["loss"]) == 3 and all(math.isfinite(v) for v in saved["loss"])
    assert math.isfinite(saved["valid_loss"])
    # 4 attention projections + 2 MLP layers (stacked over the 2 layers): one call
    # converted them all; the LM head stayed as it was.
    assert saved["fp8_layers"] == 6, proc.stdout
    if recipe == "delayed":
        assert saved["n_fp8_arrays"] == 6 * 3 * 3       # stacked states, 3 arrays each
        assert any(v > 0 for v in saved["amax_history"])
    else:
        assert saved["n_fp8_arrays"] == 0 and saved["amax_history"] is None
    assert "step 3/3" in proc.stderr and "final train loss" in proc.stdout
    assert {p.name for p in out.iterdir()} == {"metrics.json"}
    for d in ("cwd", "home", "tmpdir"):
        assert not list((tmp_path / d).iterdir()), d


def test_equinox_demo_smoke(tmp_path):
    """The Equinox example: the FP8 run and the float32 run of the same model, one
    metrics.json with both and the FP8 run's gap."""
    pytest.importorskip("equinox")
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    proc = _run("train_fp8_equinox.py",
                ["--steps", "3", "--out", str(out), "--d-model", "16", "--layers", "2",
                 "--heads", "2", "--seq-len", "16", "--batch", "4", "--history-len", "4",
                 "--eval-batches", "1"], cwd, _env(tmp_path))
    assert proc.returncode == 0, proc.stderr[-5000:]
    saved = json.loads((out / "metrics.json").read_text())
    for run in ("fp8", "float32"):
        assert len(saved[run]["loss"]) == 3 and all(math.isfinite(v) for v in saved[run]["loss"])
        assert math.isfinite(saved[run]["valid_loss"])
    # 4 attention projections + 2 MLP layers, each state stacked over the 2 layers; the
    # LM head stays in float32.
    assert saved["fp8"]["fp8_states"] == 6 and saved["float32"]["fp8_states"] == 0
    assert math.isfinite(saved["valid_gap_to_float32"])
    assert "fp8 (delayed): step 3/3" in proc.stderr and "of float32's" in proc.stdout
    assert {p.name for p in out.iterdir()} == {"metrics.json"}
    for d in ("cwd", "home", "tmpdir"):
        assert not list((tmp_path / d).iterdir()), d


def _cached_env(tmp_path):
    # (Test-only: a compilation cache under tmp_path shares compiles between processes.)
    return _env(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


CONV_RUNS = ["--runs", "bf16,jax_fp8_delayed"]


def _conv(tmp_path, args, env=None):
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    return _run("convergence.py", COMMON + args, cwd, env or _cached_env(tmp_path))


def test_convergence_seeds_resume_summarize(tmp_path):
    out = tmp_path / "conv"
    conv = _load("convergence.py")
    # 1. Seed 0 stops after 2 of 4 steps (as --max-minutes does): checkpointed, no result
    #    files, status 3.
    p = _conv(tmp_path, CONV_RUNS + ["--seeds", "0", "--out", str(out), "--stop-after", "2",
                                     "--exit-code-unfinished", "3"])
    assert p.returncode == 3, p.stderr[-5000:]
    assert not (out / "runs").exists()
    for name in ("bf16", "jax_fp8_delayed"):
        assert (out / "ckpt" / f"{name}_s0" / "2").is_dir()
        assert f"{name:22s}    0  stopped at step 2/4" in p.stdout, p.stdout
    # 2. Seeds 0 and 1: seed 0 resumes from step 2, seed 1 starts; each run compiles once.
    p = _conv(tmp_path, CONV_RUNS + ["--seeds", "0,1", "--out", str(out),
                                     "--source-commit", "abc123"])
    assert p.returncode == 0, p.stderr[-5000:]
    assert p.stderr.count("resumed from") == 2 and p.stderr.count("compiled the step") == 2
    assert not (out / "ckpt").exists()          # removed once every run is finished
    files = sorted(f.name for f in (out / "runs").iterdir())
    assert files == ["bf16_s0.json", "bf16_s1.json", "jax_fp8_delayed_s0.json",
                     "jax_fp8_delayed_s1.json"]
    got = {(r["run"], r["seed"]): r for r in conv.load_results(out)}
    for (name, seed), r in got.items():
        assert r["steps"] == 4 and r["config"]["steps"] == 4 and r["device"]
        assert r["source_commit"] == "abc123"
        assert [q["start_step"] for q in r["processes"]] == ([0, 2] if seed == 0 else [0])
        cur = r["curves"]
        assert cur["val_steps"] == [0, 2, 4] and cur["block_end"] == [2, 4]
        assert math.isclose(r["final_val_loss"], cur["val_loss"][-1], rel_tol=1e-5)
        # Last 20 % of 4 steps: after step 3, the evaluation at step 4 and train step 4.
        assert r["tail_val_loss"] == r["final_val_loss"] and r["tail_val_change"] is None
        assert all(math.isfinite(v) for v in cur["train_loss"] + cur["grad_norm"])
        assert r["e5m2_underflow"]["steps"] == [0, 2]
        for series in r["e5m2_underflow"]["layers"].values():
            assert all(0 <= v <= 1 for v in series["current_scale"])
            assert all(v > 0 for v in series["grad_amax"]) and len(series["grad_amax"]) == 2
            own = series["run_scale"]
            assert own == [None, None] if name == "bf16" else all(0 <= v <= 1 for v in own)
        assert len(r["fp8_tracked"]) == (6 if name == "jax_fp8_delayed" else 0)
        assert r["tokens_per_s"] > 0
    # The seeds differ (weights and batches); the runs of one seed start alike.
    assert got[("bf16", 0)]["curves"]["val_loss"][0] != got[("bf16", 1)]["curves"]["val_loss"][0]
    # 3. Finished runs are skipped without training; another configuration is refused.
    res = conv.main(COMMON + CONV_RUNS + ["--seeds", "1,0", "--out", str(out)])
    assert res["unfinished"] == [] and set(res["finished"]["bf16"]) == {0, 1}
    with pytest.raises(SystemExit, match="another configuration"):
        conv.main(COMMON + CONV_RUNS + ["--out", str(out), "--lr", "1e-3"])
    # 4. --summarize: results.json, the tables, the doc block, the plots.
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{conv.DOC_BEGIN}\nold\n{conv.DOC_END}\nafter\n")
    summary = conv.main(["--summarize", "--out", str(out), "--doc", str(doc)])
    assert json.loads((out / "results.json").read_text()) == summary
    fp8 = summary["runs"]["jax_fp8_delayed"]
    for key in ("final_val_loss", "tail_val_loss"):
        per_seed = {s: 100 * (got[("jax_fp8_delayed", s)][key] - got[("bf16", s)][key])
                    / got[("bf16", s)][key] for s in (0, 1)}
        st = fp8["vs_bf16_pct"][key]
        assert st["n"] == 2 and st["per_seed"] == {str(s): v for s, v in per_seed.items()}
        assert st["mean"] == pytest.approx((per_seed[0] + per_seed[1]) / 2, rel=1e-12)
    text = doc.read_text()
    assert text.startswith("intro\n" + conv.DOC_BEGIN) and text.endswith(conv.DOC_END + "\nafter\n")
    assert "old" not in text and "| `jax_fp8_delayed` | 2 |" in text
    assert summary["source_commits"] == ["abc123"] and "source abc123)" in text
    if HAS_MPL:
        assert (out / "loss.png").is_file() and (out / "fp8.png").is_file()
        assert "![loss](conv/loss.png)" in text
    assert not list((tmp_path / "cwd").iterdir()) and not list((tmp_path / "home").iterdir())


def _result(conv, run, seed, final, tail, config=None):
    cfg = config or conv.PRESETS["smoke"].comparable()
    return {"run": run, "seed": seed, "config": cfg, "description": run, "recipe": None,
            "final_val_loss": final, "tail_val_loss": tail, "tail_train_loss": tail + 0.5,
            "tokens_per_s": 1000.0, "device": "cpu", "jax_version": "x", "attention": "xla",
            "source_commit": "abc", "preset": "smoke", "params": 1, "tokens_per_step": 1,
            "flops_per_token": {}, "data": {"python": "3", "files_train": 1},
            "curves": {"val_steps": [0, 8], "val_loss": [5.0, final], "block_end": [8],
                       "train_loss": [tail]}}


def test_convergence_summary_statistics():
    conv = _load("convergence.py")
    res = [_result(conv, "bf16", 0, 2.0, 2.5), _result(conv, "bf16", 1, 4.0, 5.0),
           _result(conv, "bf16", 2, 3.0, 3.0),
           _result(conv, "jax_fp8_current", 0, 2.2, 2.5),
           _result(conv, "jax_fp8_current", 1, 4.0, 4.0),
           _result(conv, "jax_fp8_current", 5, 1.0, 1.0)]   # no bf16 of seed 5
    s = conv.summarize(res)
    assert list(s["runs"]) == ["bf16", "jax_fp8_current"]
    bf = s["runs"]["bf16"]
    assert bf["seeds"] == [0, 1, 2] and "vs_bf16_pct" not in bf
    assert bf["final_val_loss"]["mean"] == 3.0 and bf["final_val_loss"]["std"] == 1.0
    cur = s["runs"]["jax_fp8_current"]
    assert cur["final_val_loss"]["n"] == 3
    paired = cur["vs_bf16_pct"]["final_val_loss"]
    assert paired["n"] == 2 and paired["per_seed"]["0"] == pytest.approx(10.0)
    assert paired["per_seed"]["1"] == 0.0
    assert paired["mean"] == pytest.approx(5.0) and paired["std"] == pytest.approx(50 ** 0.5)
    # t(0.975, 1) = 12.7062: the 95 % interval of a mean over two seeds.
    assert paired["ci95"] == pytest.approx(12.7062 * 50 ** 0.5 / 2 ** 0.5, rel=1e-4)
    along = cur["vs_bf16_val_along_pct"]
    assert along["steps"] == [8]      # every fraction of the run maps to the last evaluation
    assert along["stats"][0]["per_seed"] == paired["per_seed"]
    along_steps = sys.modules["convergence_report"].along_steps
    assert along_steps([0, 250, 500, 750, 1000], 1000) == [250, 500, 750, 1000]
    assert along_steps([0, 300, 600, 900, 1000], 1000) == [300, 600, 900, 1000]
    tail = cur["vs_bf16_pct"]["tail_val_loss"]["per_seed"]
    assert tail == {"0": 0.0, "1": pytest.approx(-20.0)}
    table = conv.markdown_tables(s)
    assert "| `jax_fp8_current` | 3 | 2.4000 ± 1.5100 |" in table
    assert "+5.00 ± 7.07 % (n=2) | -58.53 … +68.53 % |" in table
    assert "| run | step 8 |" in table
    one = conv.summarize([_result(conv, "bf16", 0, 2.0, 2.5)])["runs"]["bf16"]
    assert one["final_val_loss"]["std"] is None and "| `bf16` | 1 | 2.0000 |" in \
        conv.markdown_tables(conv.summarize([_result(conv, "bf16", 0, 2.0, 2.5)]))
    other = dict(conv.PRESETS["smoke"].comparable(), steps=9)
    with pytest.raises(SystemExit, match="another config"):
        conv.summarize(res + [_result(conv, "bf16", 3, 1.0, 1.0, other)])
    with pytest.raises(SystemExit, match="no finished runs"):
        conv.summarize([])


def test_convergence_schedule_and_last_part():
    conv = _load("convergence.py")
    cfg = conv.Config(d_model=8, layers=1, heads=1, seq=8, batch=1, steps=100, lr=1e-3,
                      warmup=10, min_lr_ratio=0.01, decay_fraction=0.8)
    lr = sys.modules["convergence_setup"].learning_rate(cfg)
    vals = [float(lr(t)) for t in range(101)]
    assert cfg.decay_end == 80 and cfg.tail_start == 80
    assert vals[0] == 0.0 and vals[10] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(vals[:10], vals[1:11]))            # warmup
    assert all(a >= b for a, b in zip(vals[10:80], vals[11:81]))         # decay
    assert vals[80:] == [pytest.approx(1e-5)] * 21                       # the floor
    assert vals[45] == pytest.approx(1e-5 + (1e-3 - 1e-5) / 2)          # cosine midpoint
    # The last part: the values after step 80.
    steps, vals = [0, 80, 90, 95, 100], [5.0, 3.0, 2.0, 1.5, 1.0]
    assert sys.modules["convergence_report"].tail_mean(steps, vals, cfg) == 1.5
    # -0.1 per step x 20
    assert sys.modules["convergence_report"].tail_change(steps, vals, cfg) == pytest.approx(-2.0)
    assert sys.modules["convergence_report"].tail_change(steps[:3], vals[:3], cfg) is None


@pytest.mark.slow
def test_convergence_resumed_run_equals_uninterrupted(tmp_path):
    args = ["--runs", "jax_fp8_delayed", "--record-every", "1"]
    p = _conv(tmp_path, args + ["--out", str(tmp_path / "resumed"), "--stop-after", "2"])
    assert p.returncode == 0, p.stderr[-5000:]
    for d in ("resumed", "straight"):
        p = _conv(tmp_path, args + ["--out", str(tmp_path / d)])
        assert p.returncode == 0, p.stderr[-5000:]
    a, b = (json.loads((tmp_path / d / "runs" / "jax_fp8_delayed_s0.json").read_text())
            for d in ("straight", "resumed"))
    # Same batches, same initial weights, restored optimizer and FP8 state: bit for bit.
    for key in ("curves", "fp8_tracked", "e5m2_underflow", "final_val_loss",
                "tail_val_loss", "tail_train_loss"):
        assert a[key] == b[key], key


def test_convergence_skips_a_recipe_the_library_refuses(tmp_path, monkeypatch):
    conv = _load("convergence.py")
    # A recipe that this jax_fp8 does not have, and an object its layers refuse as one.
    monkeypatch.setitem(conv.RUNS, "missing", sys.modules["convergence_setup"].RunSpec(
        "jax_fp8", "not in jax_fp8",
        sys.modules["convergence_setup"]._recipe("Float8NoSuchScaling")))
    monkeypatch.setitem(conv.RUNS, "refused", sys.modules["convergence_setup"].RunSpec(
        "jax_fp8", "not a recipe", lambda: object()))
    out = tmp_path / "out"
    res = conv.main(COMMON + ["--runs", "missing,refused", "--seeds", "0,1", "--out",
                              str(out)])
    assert res["finished"] == {} and res["unfinished"] == []
    assert set(res["skipped"]) == {"missing", "refused"}
    assert "Float8NoSuchScaling" in res["skipped"]["missing"]
    assert all("does not accept" in why for why in res["skipped"].values())
    assert not (out / "runs").exists()
