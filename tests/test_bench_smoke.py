"""Smoke test of bench/bench_update.py: a tiny configuration, every column, fast (< 30 s)."""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH_DIR)

import bench_update  # noqa: E402

ALL_COLUMNS = ("per_tensor_jnp", "stacked_jnp", "fused_pytree", "fused_stacked", "floor")


def test_tiny_run_has_all_five_columns(tmp_path, capsys):
    out = tmp_path / "results.json"
    data = bench_update.run(["--sizes", "3", "--lengths", "16", "--warmup", "1",
                             "--min-calls", "1", "--max-calls", "1", "--wall-seconds", "0",
                             "--trace-reps", "1", "--out", str(out)])
    rows = {(r["n"], r["l"], r["column"]): r for r in data["results"]}
    for col in ALL_COLUMNS:
        row = rows[(3, 16, col)]
        assert row["wall_us_median"] > 0
        assert row["kernels_hlo"] >= 1
        assert row["wall_calls"] == 1
    # The fused update is one custom call whatever the layout.
    assert rows[(3, 16, "fused_pytree")]["kernels_hlo"] == 1
    assert rows[(3, 16, "fused_stacked")]["kernels_hlo"] == 1
    assert rows[(3, 16, "per_tensor_jnp")]["kernels_hlo"] > rows[(3, 16, "stacked_jnp")][
        "kernels_hlo"]
    assert data["failures"] == []
    assert data["launch_floor"]["kernels_hlo"] == 1
    # JSON written and readable, markdown table printed.
    saved = json.loads(out.read_text())
    assert len(saved["results"]) == 5
    assert saved["meta"]["jax_version"]
    printed = capsys.readouterr().out
    assert "| N | L | per-tensor jnp | stacked jnp | fused pytree | fused stacked | copy floor |" \
        in printed
    assert "Targets" in printed


def test_donation_threads_state():
    # The state is donated and threaded: the fused pytree call must alias every byte.
    import jax.numpy as jnp

    base = bench_update.initial_history(3, 16)
    state = bench_update.make_state("fused_pytree", base)
    compiled, _ = bench_update._compile(bench_update.fused_pytree, state, ())
    alias = bench_update._alias_bytes(compiled)
    if alias is not None:
        assert alias == bench_update.tree_bytes(state)
    new = compiled(state)
    assert state[0].amax_history.is_deleted()
    assert float(new[0].amax_history[0]) == 0.0
    assert new[0].scale.dtype == jnp.float32


HLO = """HloModule jit_f, is_scheduled=true

%fused_computation (param_0: f32[16]) -> f32[16] {
  %param_0 = f32[16]{0} parameter(0)
  ROOT %copy.2 = f32[16]{0} copy(%param_0)
}

%command_buffer (p: f32[16], q: f32[]) -> (f32[16], f32[]) {
  %p = f32[16]{0} parameter(0)
  %q = f32[] parameter(1)
  %loop_fusion = f32[16]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  %loop_fusion.1 = f32[] fusion(%q), kind=kLoop, calls=%fused_computation
  ROOT %t = (f32[16]{0}, f32[]) tuple(%loop_fusion, %loop_fusion.1)
}

ENTRY %main.1 (a: f32[16], b: f32[]) -> (f32[16], f32[], /*index=2*/f32[16]) {
  %a = f32[16]{0} parameter(0), metadata={op_name="a"}
  %b = f32[] parameter(1)
  %c = f32[] constant(1)
  %call = (f32[16]{0}, f32[]) call(%a, %b), to_apply=%command_buffer
  %gte = f32[16]{0} get-tuple-element(%call), index=0
  %cc = (f32[16]{0}, f32[16]{0}, f32[]) custom-call(%a, %b), custom_call_target="jax_fp8_update", output_to_operand_aliasing={{0}: (0, {})}
  %copy.1 = f32[16]{0} copy(%gte)
  ROOT %tuple = (f32[16]{0}, f32[], /*index=2*/f32[16]{0}) tuple(%copy.1, %b, %gte)
}
"""


def test_count_kernels_hlo():
    total, by_opcode = bench_update.count_kernels_hlo(HLO)
    assert by_opcode == {"copy": 1, "custom-call": 1, "fusion": 2}
    assert total == 4


def _gpu_trace_events():
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name",
         "args": {"name": "/device:GPU:0 (NVIDIA)"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
         "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    kernels = [{"ph": "X", "pid": 2, "tid": 7, "ts": 10.0 * i, "dur": 1.5, "name": "k"}
               for i in range(4)]
    derived = [{"ph": "X", "pid": 2, "tid": 9, "ts": 0.0, "dur": 50.0, "name": "fusion"}]
    host = [{"ph": "X", "pid": 1, "tid": 3, "ts": 0.0, "dur": 100.0, "name": "PjitFunction",
             "args": {"hlo_op": "x"}}]
    return meta + kernels + derived + host


def test_summarize_gpu_trace():
    summary = bench_update.summarize_trace(_gpu_trace_events(), "gpu")
    assert summary["events"] == 4
    assert summary["total_us"] == pytest.approx(6.0)


def test_traced_device_time_parses_a_written_trace(tmp_path, monkeypatch):
    # The GPU path end to end, with the profiler replaced by a canned GPU trace.
    def fake_start(logdir):
        d = os.path.join(logdir, "plugins", "profile", "run")
        os.makedirs(d)
        with gzip.open(os.path.join(d, "host.perfetto_trace.json.gz"), "wt") as fp:
            json.dump({"traceEvents": _gpu_trace_events()}, fp)

    monkeypatch.setattr(bench_update, "_start_trace", fake_start)
    monkeypatch.setattr(bench_update.jax.profiler, "stop_trace", lambda: None)
    state, info = bench_update.traced_device_time(lambda s: s + 1, 0, 2, "gpu")
    assert state == 2
    assert info["device_us"] == pytest.approx(3.0)
    assert info["events_per_call"] == 2


def test_gpu_targets_evaluate():
    rows = []
    for col, us, k in (("per_tensor_jnp", 5300.0, 5760), ("stacked_jnp", 13.8, 6),
                       ("fused_pytree", 3.0, 1), ("fused_stacked", 3.0, 1), ("floor", 2.9, 1)):
        rows.append({"n": 1152, "l": 1024, "column": col, "device_us": us, "kernels_hlo": k,
                     "kernels_trace": float(k), "wall_us_median": 100.0})
    targets = {t["name"]: t for t in bench_update.evaluate_targets(
        rows, {"device_us": 1.2}, "gpu")}
    assert targets["gpu_one_kernel"]["met"] is True
    assert targets["gpu_one_kernel_trace"]["met"] is True
    assert targets["gpu_near_floor"]["met"] is True  # 3.0 <= 1.5 * (2.9 + 1.2)
    assert targets["gpu_vs_per_tensor_jnp"]["met"] is True
    assert targets["gpu_vs_stacked_jnp"]["met"] is True
    missing = bench_update.evaluate_targets(rows, None, "gpu")
    assert {t["name"]: t["met"] for t in missing}["gpu_near_floor"] is None


def _fake_gpu_data():
    rows = []
    for n in (3, 1152):
        for col, us, k in (("per_tensor_jnp", 4.6 * n, 5 * n), ("stacked_jnp", 13.8, 6),
                           ("fused_pytree", 3.0, 1), ("fused_stacked", 3.0, 1),
                           ("floor", 2.9, 1)):
            rows.append({"n": n, "l": 1024, "column": col, "label": col, "device_us": us,
                         "kernels_hlo": k, "kernels_trace": float(k), "wall_us_median": 90.0})
    rows = [r for r in rows if not (r["n"] == 3 and r["column"] == "floor")]  # a gap
    meta = {"device": "NVIDIA H200", "platform": "gpu", "jax_version": "0.11.2",
            "jaxlib_version": "0.11.2", "jax_fp8_version": "0.1.0", "has_cpu_kernel": True,
            "has_cuda_kernel": True, "date": "today", "command": "python bench/bench_update.py",
            "total_s": 1.0,
            "settings": {"sizes": [3, 1152], "lengths": [1024],
                         "columns": list(ALL_COLUMNS)}}
    lf = {"what": "launch floor", "kernels_hlo": 1, "device_us": 1.1, "wall_us_median": 80.0,
          "kernels_trace": 1.0}
    return {"meta": meta, "columns": [{"key": k, "label": k} for k in ALL_COLUMNS],
            "results": rows, "launch_floor": lf,
            "ratios": bench_update.compute_ratios(rows, [3, 1152], [1024]),
            "targets": bench_update.evaluate_targets(rows, lf, "gpu"),
            "failures": [{"n": 48, "l": 16, "error": "boom"}], "skipped": [{"n": 4608, "l": 16}]}


def test_gpu_report_and_plot(tmp_path):
    data = _fake_gpu_data()
    report = bench_update.markdown_report(data)
    assert "GPU time per update" in report
    assert "[MET] N=1152, L=1024: fused pytree launches 1 kernel (HLO)" in report
    assert "| 1152 | 1024 | 5760 |" in report
    assert "FAILED N=48 L=16" in report and "skipped (time limit): N=4608 L=16" in report
    pytest.importorskip("matplotlib")
    import plot as bench_plot

    png = tmp_path / "p.png"
    bench_plot.plot(data, str(png))
    assert png.stat().st_size > 1000


def test_per_tensor_max_n_skips_only_that_column():
    data = bench_update.run(["--sizes", "3", "--lengths", "4", "--warmup", "0",
                             "--min-calls", "1", "--max-calls", "1", "--wall-seconds", "0",
                             "--no-trace", "--no-launch-floor", "--per-tensor-max-n", "2"])
    cols = sorted(r["column"] for r in data["results"])
    assert cols == sorted(c for c in ALL_COLUMNS if c not in ("per_tensor_jnp", "fused_pytree"))
    assert "device_us" not in data["results"][0]


def test_compile_time_guard():
    log = {"fused_pytree": [(3, 0.06), (48, 0.3), (384, 10.9)]}
    guess = bench_update._predict_compile_s(log, "fused_pytree", 1152)
    assert guess > 2 * 10.9 * 3  # superlinear, pessimistic
    assert bench_update._predict_compile_s(log, "fused_pytree", 3) is None
    assert bench_update._predict_compile_s({"x": [(3, 1.0)]}, "x", 6) == pytest.approx(2 * 2 ** 1.5)
    # A fitted exponent is capped at 3: small-N compiles are mostly fixed overhead.
    assert bench_update._predict_compile_s({"x": [(3, 0.01), (6, 10.0)]}, "x", 12) == \
        pytest.approx(2 * 10.0 * 2 ** 3)
    # --time-limit 0: the first configuration still runs, later ones are skipped.
    data = bench_update.run(["--sizes", "3,4", "--lengths", "4", "--warmup", "0",
                             "--min-calls", "1", "--max-calls", "1", "--wall-seconds", "0",
                             "--no-trace", "--no-launch-floor", "--time-limit", "0",
                             "--max-n", "floor=1"])
    assert {r["n"] for r in data["results"]} == {3}
    assert data["skipped"] == [{"n": 4, "l": 4}]
    assert [s["column"] for s in data["skipped_columns"]] == ["floor"]
    assert "Columns skipped" in data["report_markdown"]


def test_from_json_rerenders_a_partial_run(tmp_path):
    data = _fake_gpu_data()
    partial = {"meta": data["meta"], "results": data["results"], "partial": True,
               "failures": [], "skipped": [], "skipped_columns": []}
    src = tmp_path / "partial.json"
    src.write_text(json.dumps(partial))
    out = bench_update.run(["--from-json", str(src), "--outdir", str(tmp_path / "o")])
    assert out["report_markdown"].startswith("(partial results")
    assert (tmp_path / "o" / "results.md").exists()
    assert json.loads((tmp_path / "o" / "results.json").read_text())["targets"]


def test_a_failing_column_does_not_stop_the_others(monkeypatch):
    def broken(state):
        raise RuntimeError("no kernel here")

    monkeypatch.setitem(bench_update.FUNCTIONS, "fused_stacked", broken)
    data = bench_update.run(["--sizes", "3", "--lengths", "4", "--warmup", "1",
                             "--min-calls", "1", "--max-calls", "1", "--wall-seconds", "0",
                             "--no-trace", "--no-launch-floor"])
    cols = {r["column"] for r in data["results"]}
    assert cols == set(ALL_COLUMNS) - {"fused_stacked"}
    assert data["failures"][0]["column"] == "fused_stacked"
    assert "FAILED N=3 L=4 fused_stacked" in data["report_markdown"]


def test_bench_transpose_quick(tmp_path, capsys):
    """bench/bench_transpose.py runs end to end (small shapes; times mean nothing on CPU)
    and checks the kernel's bits on the way."""
    import bench_transpose
    out = tmp_path / "t.json"
    bench_transpose.main(["--quick", "--reps", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "| 132x260 |" in text and "Quantize (E5M2" in text
    data = json.loads(out.read_text())
    assert [r["shape"] for r in data["rows"]] == [[128, 256], [132, 260]]
    assert data["quantize_transpose"][0]["kernel"]["us"] > 0
