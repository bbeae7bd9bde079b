"""CPU smoke test of bench/bench_moe.py: the tiny MoE block, bf16 (jax_fp8.ragged_dot and XLA's
ragged_dot) and every FP8 recipe, a table row each, each first loss checked against the
float32 reference, the grouped GEMMs' lowering named (the reference here)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository
sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402


def test_bench_moe_tiny_run(tmp_path):
    proc = common.run_tiny("bench_moe.py", tmp_path)
    data = json.loads((tmp_path / "moe.json").read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"bf16", "bf16_xla", "delayed", "current", "block", "mxfp8"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["wall_ms"] > 0 and abs(r["loss"] - rows["bf16"]["loss"]) < 0.05, r
        assert abs(r["first_loss"] - r["reference_loss"]) < 0.1 * abs(r["reference_loss"]), r
    assert rows["delayed"]["grouped_lowering"] == ["reference: no cpu kernel"]
    assert rows["block"]["grouped_lowering"] == [
        "blocks emulated (float32 dequantized ragged_dot)"]
    md = (tmp_path / "moe.md").read_text()
    assert "| tiny | mxfp8 |" in md and md.strip() in proc.stdout
