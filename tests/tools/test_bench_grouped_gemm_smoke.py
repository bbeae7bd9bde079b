"""CPU smoke test of bench/bench_grouped_gemm.py: the tiny model, every column measured (the
grouped kernel's column runs the reference here, and the table says so)."""

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
                                         "down dgrad"]
    for r in rows:
        assert set(r["tflops"]) == {"fp8_grouped", "bf16_ragged_dot", "reference",
                                    "dense_fp8_fast", "dense_fp8_f32acc"}, r["errors"]
        assert r["rows"] == 32 and r["kernel"] is False
        # the same FP8 values through bf16 ragged_dot: equal up to bf16 output rounding
        assert r["rel_diff"]["reference"] <= 2.0 ** -8
    md = (tmp_path / "grouped_gemm.md").read_text()
    assert "| tiny | down dgrad | 4 | 32 (" in md and "no custom call" in md
    assert md.strip() in proc.stdout
