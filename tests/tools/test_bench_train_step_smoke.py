"""CPU smoke tests of bench/bench_train_step.py (--cpu-smoke: one block, d = 32, 32 tokens),
run as a user runs it, in a subprocess: every variant, the report, the fresh-process
compile mode; and bench/xla_log.py, which reads XLA's compile log. (The HLO and trace
parsing the benchmark uses is tested in test_devtools.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jax_fp8

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository
sys.path.insert(0, os.path.join(ROOT, "bench"))
import xla_log  # noqa: E402

MEASURED = ("bf16", "flax_fp8", "jax_fp8", "jax_fp8_unpacked", "jax_fp8_min_flops")
RECIPES = ("jax_fp8_current", "jax_fp8_blockwise")


def run_bench(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "bench/bench_train_step.py", "--cpu-smoke", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert "\r" not in proc.stderr          # a log gets lines, never carriage returns
    return proc


@pytest.mark.skipif(not jax_fp8.HAS_CPU_KERNEL,
                    reason="jax_fp8's CPU kernel not built (the jax_fp8 steps are checked to "
                           "hold one jax_fp8_update custom call)")
def test_every_variant_side_by_side(tmp_path):
    proc = run_bench("--variants", "all", "--steps", "1", "--warmup", "0", "--trace-steps", "1",
                     "--outdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-5000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert not data["partial"] and not data["failures"], data["failures"]
    rows = {r["variant"]: r for r in data["results"]}
    # A recipe this jax_fp8 does not take yet is skipped, saying so; else it is measured.
    skipped = {s["variant"]: s["reason"] for s in data["skipped"]}
    assert set(rows) | set(skipped) == set(MEASURED + RECIPES) and set(MEASURED) <= set(rows)
    for v, reason in skipped.items():
        assert v in RECIPES and "does not take recipe=jax_fp8.Float8" in reason, reason
    for v in MEASURED:
        r = rows[v]
        assert r["size"] == "32x1x32" and r["loss_finite"], v
        for key in ("device_ms", "pipelined_ms", "blocked_ms", "compile_s", "gemm_ms",
                    "non_gemm_ms"):
            assert r[key] > 0, (v, key)
        assert r["temp_bytes"] is not None and r["families_ms"] and r["top_kernels"], v
        assert r["hlo"]["gemms_fp8"] + r["hlo"]["gemms_other"] >= 8, v   # 4 Dense, fwd + bwd
        assert r["hlo"]["jax_fp8_update"] == (1 if v.startswith("jax_fp8") else 0), v
    # Packed: 3 arrays per (FP8 dtype, history length) group instead of 3 per tensor.
    assert rows["jax_fp8"]["state_arrays"] < rows["jax_fp8_unpacked"]["state_arrays"]
    per = data["derived"]["32x1x32"]
    assert per["bf16"]["device_ms:vs_bf16"] == pytest.approx(1.0)
    assert per["flax_fp8"]["pipelined_ms:vs_flax"] == pytest.approx(1.0)
    assert per["jax_fp8"]["non_gemm_minus_bf16_ms"] == pytest.approx(
        rows["jax_fp8"]["non_gemm_ms"] - rows["bf16"]["non_gemm_ms"])
    md = (tmp_path / "results.md").read_text()
    assert md.strip() in proc.stdout
    for text in ("## d = 32, 1 blocks, 32 tokens", "| bf16 (nn.Dense) |",
                 "| jax_fp8 (Fp8TrainState, packed) |", "FP8 GEMM floor ms",
                 "| non-GEMM kernels, ms/step | bf16 | flax_fp8 | jax_fp8 | jax_fp8_unpacked |"):
        assert text in md, text
    assert f"[{len(MEASURED + RECIPES)}/{len(MEASURED + RECIPES)}]" in proc.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in proc.stderr
    else:
        assert (tmp_path / "train_step.png").stat().st_size > 1000


def test_compile_fresh_compiles_in_a_new_process(tmp_path):
    proc = run_bench("--variants", "jax_fp8", "--compile-fresh", "--compile-only",
                     "--outdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-5000:]
    data = json.loads((tmp_path / "results.json").read_text())
    (r,) = data["results"]
    assert r["variant"] == "jax_fp8" and r["compile_fresh_s"] > 0 and r["lower_fresh_s"] > 0
    assert r["compile_s"] is None and "device_ms" not in r     # nothing else compiled or ran
    assert r["hlo"]["jax_fp8_update"] == int(jax_fp8.HAS_CPU_KERNEL) and r["state_arrays"]
    assert "[1/2] 32x1x32 jax_fp8: fresh compile" in proc.stderr
    kept = json.loads((tmp_path / "fresh_compiles.json").read_text())  # as they came
    assert kept["32x1x32 jax_fp8"]["compile_s"] == r["compile_fresh_s"]


def test_compile_cache_times_a_second_process_that_finds_the_first_ones_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "32x1x32_bf16").mkdir(parents=True)
    (cache / "32x1x32_bf16" / "stale").write_text("emptied before the cold compile")
    proc = run_bench("--variants", "bf16", "--compile-fresh", "--compile-only",
                     "--compile-cache", str(cache), "--outdir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    (r,) = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    assert r["compile_fresh_s"] > 0 and r["compile_cached_s"] > 0
    assert r["autotuned_fusions"] == 0           # (only XLA:GPU autotunes)
    entries = os.listdir(cache / "32x1x32_bf16")
    assert "stale" not in entries
    assert any(e.startswith("jit_plain_step") for e in entries), entries  # the step, cached
    assert "cached compile s" in (tmp_path / "out" / "results.md").read_text()


def test_compile_cache_needs_compile_fresh(tmp_path):
    proc = run_bench("--compile-cache", str(tmp_path), "--outdir", str(tmp_path))
    assert proc.returncode != 0 and "--compile-cache needs --compile-fresh" in proc.stderr


def test_compile_passes_reads_xla_s_pass_timers_from_the_fresh_compile(tmp_path):
    proc = run_bench("--variants", "bf16", "--compile-fresh", "--compile-only",
                     "--compile-passes", "--outdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-5000:]
    (r,) = json.loads((tmp_path / "results.json").read_text())["results"]
    names = [name for name, _ in r["compile_passes"]]
    assert "layout-assignment" in names and 0 < r["compile_pass_s"] < r["compile_fresh_s"]
    assert r["compile_autotune"] is None             # (only XLA:GPU autotunes)
    assert (tmp_path / "compile_log_32x1x32_bf16.txt.gz").stat().st_size > 1000
    assert "| bf16 (nn.Dense) | " in (tmp_path / "results.md").read_text().split(
        "slowest other passes |")[1]


def test_compile_passes_needs_compile_fresh(tmp_path):
    proc = run_bench("--compile-passes", "--outdir", str(tmp_path))
    assert proc.returncode != 0 and "--compile-passes needs --compile-fresh" in proc.stderr


# Lines of an XLA:GPU compile log (jax 0.11.2, H200; thread 1024 the program's, 1092 and
# 1098 autotuning workers), shortened: the autotuning pass "config-assigner" nested in a
# pipeline of the same name, a pass inside it on the main thread, two workers compiling
# candidates of one fusion and three candidates' results (one disagreeing with the
# winners), then the device runs (no lines) until the pass ends.
GPU_LOG = """\
I1201 23:59:59.000000    1024 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module jit_step: fusion
I1201 23:59:59.000010    1024 hlo_pass_pipeline.cc:211]   HLO pass priority-fusion
I1201 23:59:59.500010    1024 hlo_pass_pipeline.cc:206] HLO pass: priority-fusion time: 500 ms (500000 us) (cumulative: 0.5 s)
I1201 23:59:59.500020    1024 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module jit_step: config-assigner
I1201 23:59:59.500030    1024 hlo_pass_pipeline.cc:211]   HLO pass config-assigner
I1201 23:59:59.600000    1024 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module wrapped_concatenate_computation.1: cublaslt_rewriter_pipeline
I1201 23:59:59.600010    1024 hlo_pass_pipeline.cc:211]   HLO pass cublas-gemm-rewriter
I1201 23:59:59.600020    1024 hlo_pass_pipeline.cc:206] HLO pass: cublas-gemm-rewriter time: 10 us (10 us) (cumulative: 1 s)
I1202 00:00:00.000000    1098 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module gemm_fusion_dot_general.388: pre-scheduling-passes
I1202 00:00:00.000001    1092 hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module gemm_fusion_dot_general.388_computation: triton
2026-12-02 00:00:01,000 a line that is not XLA's
I1202 00:00:04.500030    1092 autotuner.cc:228] Using runner 0
I1202 00:00:04.500030    1092 autotuner.cc:253] {TRITON : goo.gle/debugonly  triton { block_m: 64 block_n: 128 } duration: 50.112us, scratch_bytes: 0}
I1202 00:00:04.500030    1092 autotuner.cc:253] {TRITON : goo.gle/debugonly  triton { block_m: 16 block_n: 8 } WRONG RESULTS: Output disagrees with winning cluster (member of cluster -1 of 1; winning cluster has 19 member(s), trusted=1).
Output buffer does not match reference buffer at leaf index {}:
  Mismatch count: 8807 / 8388608 (0.1050%)
  Relative tolerance: 0.01
 duration: 1.604544ms, scratch_bytes: 0}
I1202 00:00:04.500030    1092 autotuner.cc:253] {CUBLASLT_FISSION : goo.gle/debugonly  gemm { algorithm: 1 } duration: 40.32us, scratch_bytes: 33554432}
I1202 00:00:09.500030    1024 hlo_pass_pipeline.cc:206] HLO pass: config-assigner time: 10 s (10000000 us) (cumulative: 10.5 s)
I1202 00:00:09.500040    1024 hlo_pass_pipeline.cc:211]   HLO pass copy-insertion
I1202 00:00:09.800040    1024 hlo_pass_pipeline.cc:206] HLO pass: copy-insertion time: 300 ms (300000 us) (cumulative: 10.8 s)
"""


def test_xla_log_splits_gpu_autotuning_into_candidate_compiles_and_their_runs():
    lines = xla_log.parse(GPU_LOG)
    assert len(lines) == 17 and lines[-1].t - lines[0].t == pytest.approx(10.80004)  # midnight
    assert xla_log.main_thread(lines) == 1024
    # Own time: config-assigner without the pass run inside it.
    assert xla_log.pass_times(lines) == pytest.approx(
        {"config-assigner": 10 - 10e-6, "priority-fusion": 0.5, "copy-insertion": 0.3,
         "cublas-gemm-rewriter": 10e-6})
    a = xla_log.autotuning(lines)
    assert a["passes"] == ["config-assigner"] and a["fusions"] == 1
    assert a["s"] == pytest.approx(10) and a["compile_s"] == pytest.approx(5)
    assert a["after_s"] == pytest.approx(5)
    s = xla_log.summary(GPU_LOG, top=2)
    assert [name for name, _ in s["passes"]] == ["config-assigner", "priority-fusion"]
    assert s["pass_s"] == pytest.approx(10.8) and s["autotune"] == a
    assert s["candidate_checks"] == {"candidates": {"CUBLASLT_FISSION": 1, "TRITON": 2},
                                     "disagreeing": 1, "disagreeing_elements": 8807}
    assert xla_log.candidate_checks("no candidates here") is None
