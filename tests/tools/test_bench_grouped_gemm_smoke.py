"""CPU smoke test of bench/bench_grouped_gemm.py: the tiny model, every column measured (the
kernel columns run the references here), every result checked against the bf16 grouped
GEMM's."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository
sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402


def test_bench_grouped_gemm_tiny_run(tmp_path):
    proc = common.run_tiny("bench_grouped_gemm.py", tmp_path)
    data = json.loads((tmp_path / "grouped_gemm.json").read_text())
    rows = data["rows"]
    assert [r["gemm"] for r in rows] == ["gate_up fwd", "down fwd", "gate_up dgrad",
                                         "down dgrad", "gate_up wgrad", "down wgrad"]
    for r in rows:
        assert set(r["tflops"]) == {"fp8_grouped", "bf16_grouped", "bf16_xla", "reference",
                                    "dense_fp8_fast", "dense_fp8_f32acc"}, r["errors"]
        assert r["rows"] == 32 and r["checked_against"] == "bf16_grouped"
        # the same FP8 values in bfloat16: equal up to the bf16 output's rounding
        for column in ("fp8_grouped", "bf16_xla", "reference"):
            assert r["rel_diff"][column] <= 2.0 ** -8, (r["gemm"], column)
    md = (tmp_path / "grouped_gemm.md").read_text()
    assert "| tiny | down wgrad | 4 | 32 (" in md
    assert md.strip() in proc.stdout
