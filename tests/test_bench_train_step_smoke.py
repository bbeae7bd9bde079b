"""Smoke test of bench/bench_train_step.py: a tiny model, all five variants, in a subprocess.

Also checks the HLO analysis on a hand-written GPU-style module (cuBLASLt FP8 custom
calls inside a command buffer, a Triton FP8 GEMM fusion), which CPU runs never produce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jax_fp8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "bench_train_step.py")
VARIANTS = ("bf16", "flax_fp8", "flax_fp8_noupdate", "jax_fp8", "jax_fp8_noupdate",
            "jax_fp8_packed", "jax_fp8_packed_noupdate")
UPDATING = ("jax_fp8", "jax_fp8_packed")  # exactly one jax_fp8_update each


@pytest.mark.skipif(not jax_fp8.HAS_CPU_KERNEL,
                    reason="jax_fp8's CPU kernel not built (the jax_fp8 step asserts one custom "
                           "call)")
def test_tiny_run_all_variants(tmp_path):
    outdir = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu")   # a CPU smoke run, also on a GPU machine
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--blocks", "2", "--d", "64", "--tokens", "64", "--steps", "2",
         "--warmup", "1", "--outdir", str(outdir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]

    data = json.loads((outdir / "results.json").read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == set(VARIANTS), proc.stderr[-4000:]
    assert not data["failures"] and not data["partial"]
    for v, r in rows.items():
        assert r["step_ms"] > 0 and r["pipelined_ms"] > 0, v
        assert r["loss_finite"], v
        assert r["hlo"]["kernels"] > 0 and r["hlo"]["fusions"] > 0, v
    # ONE fused update in the jax_fp8 steps, none in the no-update twin or elsewhere.
    for v in VARIANTS:
        assert rows[v]["hlo"]["jax_fp8_update"] == (1 if v in UPDATING else 0), v
    assert rows["jax_fp8"]["hlo"]["custom_call_targets"].get("jax_fp8_update") == 1
    # Packed: 3 arrays per (dtype, history length) group instead of 3 per FP8 tensor.
    assert rows["jax_fp8_packed"]["state_arrays"] < rows["jax_fp8"]["state_arrays"] - 40
    # The updating variants move their FP8 state, the no-update twins leave it alone.
    assert rows["jax_fp8"]["fp8_state_moved"] and rows["flax_fp8"]["fp8_state_moved"]
    assert rows["jax_fp8_packed"]["fp8_state_moved"]
    assert not rows["jax_fp8_noupdate"]["fp8_state_moved"]
    assert not rows["jax_fp8_packed_noupdate"]["fp8_state_moved"]
    assert rows["jax_fp8_packed_noupdate"]["hlo"]["jax_fp8_update"] == 0
    assert not rows["flax_fp8_noupdate"]["fp8_state_moved"]
    # Patching out Flax's update_fp8_meta removes kernels from its step.
    assert rows["flax_fp8_noupdate"]["patched"]
    assert rows["flax_fp8_noupdate"]["hlo"]["kernels"] < rows["flax_fp8"]["hlo"]["kernels"]
    assert rows["jax_fp8_noupdate"]["hlo"]["kernels"] < rows["jax_fp8"]["hlo"]["kernels"]
    # Derived numbers: bookkeeping for both FP8 variants, three targets per time measured.
    wall = data["derived"]["64x64"]["step_ms"]
    assert "bookkeeping_ms" in wall["jax_fp8"] and "bookkeeping_ms" in wall["flax_fp8"]
    assert "bookkeeping_ms" in wall["jax_fp8_packed"]
    assert wall["bf16"]["speedup_vs_bf16"] == pytest.approx(1.0)
    assert {t["target"] for t in data["targets"]} == {"bookkeeping", "vs_bf16", "vs_flax"}
    assert not any(t["binding"] for t in data["targets"])     # not the 2048x4096 size

    md = (outdir / "results.md").read_text()
    assert md.strip() in proc.stdout
    for label in ("bf16 (nn.Dense)", "Flax FP8 |", "Flax FP8, update_fp8_meta patched out",
                  "jax_fp8 (Fp8DotGeneral + Fp8TrainState)", "jax_fp8, FP8 state not updated"):
        assert label in md, label
    assert "NOT MET" in md or "MET" in md


GPU_HLO = """HloModule jit_step, is_scheduled=true

%triton_gemm_computation (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,16]) -> bf16[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%loop_body (a: bf16[64,16]) -> bf16[64,16] {
  %a = bf16[64,16]{1,0} parameter(0)
  ROOT %neg = bf16[64,16]{1,0} negate(%a)
}

%bf16_gemm (q0: bf16[64,32], q1: bf16[32,16]) -> bf16[64,16] {
  %q0 = bf16[64,32]{1,0} parameter(0)
  %q1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.2 = bf16[64,16]{1,0} dot(bf16[64,32]{1,0} %q0, bf16[32,16]{1,0} %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%command_buffer (x: f8e4m3fn[64,32], w: f8e4m3fn[32,16], s: f32[]) -> (bf16[64,16], s8[1024]) {
  %x = f8e4m3fn[64,32]{1,0} parameter(0)
  %w = f8e4m3fn[32,16]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %cublas-gemm.1 = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%x, %w, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1}}
  ROOT %t = (bf16[64,16]{1,0}, s8[1024]{0}) tuple(%cublas-gemm.1)
}

ENTRY %main (x: f8e4m3fn[64,32], w: f8e4m3fn[32,16], s: f32[], h: f32[3,16]) -> bf16[64,16] {
  %x = f8e4m3fn[64,32]{1,0} parameter(0)
  %w = f8e4m3fn[32,16]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %h = f32[3,16]{1,0} parameter(3)
  %call = (bf16[64,16]{1,0}, s8[1024]{0}) call(%x, %w, %s), to_apply=%command_buffer
  %gte = bf16[64,16]{1,0} get-tuple-element(%call), index=0
  %gemm_fusion = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %bf16_fusion = bf16[64,16]{1,0} fusion(%gte, %gte), kind=kCustom, calls=%bf16_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %loop_fusion = bf16[64,16]{1,0} fusion(%gemm_fusion), kind=kLoop, calls=%loop_body
  %upd = (f32[3,16]{1,0}) custom-call(%h), custom_call_target="jax_fp8_update", output_to_operand_aliasing={{0}: (0, {})}
  ROOT %add = bf16[64,16]{1,0} add(%loop_fusion, %bf16_fusion)
}
"""


def test_analyze_hlo_gpu_style():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_train_step

    h = bench_train_step.analyze_hlo(GPU_HLO)
    assert h["cublas_f8"] == 1                      # found inside the command buffer
    assert h["custom_call_targets"] == {"__cublas$lt$matmul$f8": 1, "jax_fp8_update": 1}
    assert h["custom_calls"] == 2
    assert h["fusions"] == 3
    assert h["f8_gemm_fusions"] == 1                # the bf16 Triton GEMM does not count
    assert h["f8_gemm_fusions_by_kind"] == {"__triton_gemm": 1}
    assert h["f8_dots_unfused"] == 0
    assert h["jax_fp8_update"] == 1
    assert h["kernels"] == 6                        # 3 fusions, 2 custom calls, the add


AMAX_HLO = """HloModule m

%fused_cast_amax (p0: bf16[8,4]) -> (f8e4m3fn[8,4], bf16[]) {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %rs = bf16[8,4]{1,0} rsqrt(%p0), metadata={op_name="jit(step)/jvp(Model)/block3/ln1/rsqrt"}
  %q = f8e4m3fn[8,4]{1,0} convert(%rs), metadata={op_name="jit(step)/jvp(Model)/block3/in3/Fp8DotGeneral_0/convert_element_type"}
  %a = bf16[8,4]{1,0} abs(%rs), metadata={op_name="jit(step)/jvp(Model)/block3/in3/Fp8DotGeneral_0/abs"}
  %c = bf16[] constant(-inf)
  %r = bf16[] reduce(%a, %c), dimensions={0,1}, to_apply=%max, metadata={op_name="jit(step)/jvp(Model)/block3/in3/Fp8DotGeneral_0/reduce_max"}
  ROOT %t = (f8e4m3fn[8,4]{1,0}, bf16[]) tuple(%q, %r)
}

%fused_adam_amax (p0: f32[8,4]) -> (f32[8,4], bf16[]) {
  %p0 = f32[8,4]{1,0} parameter(0)
  %s = f32[8,4]{1,0} add(%p0, %p0), metadata={op_name="jit(step)/add"}
  %w = bf16[8,4]{1,0} convert(%p0), metadata={op_name="jit(step)/jvp(Model)/block7/in3/convert_element_type"}
  %a = bf16[8,4]{1,0} abs(%w), metadata={op_name="jit(step)/jvp(Model)/block7/in3/Fp8DotGeneral_0/abs"}
  %c = bf16[] constant(-inf)
  %r = bf16[] reduce(%a, %c), dimensions={0,1}, to_apply=%max, metadata={op_name="jit(step)/jvp(Model)/block7/in3/Fp8DotGeneral_0/reduce_max"}
  ROOT %t = (f32[8,4]{1,0}, bf16[]) tuple(%s, %r)
}
"""


def test_amax_fusions_says_where_each_amax_landed():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import kernel_breakdown

    rows = kernel_breakdown.amax_fusions(AMAX_HLO)
    amax = "jvp(Model)/block*/in3/Fp8DotGeneral/reduce_max"
    assert sorted(rows) == sorted([
        (1, amax, True, "ln1/rsqrt"),                       # with LayerNorm and its cast
        (1, amax, False, "add, in3/convert_element_type"),  # ridden on adam's read of w
    ])


def test_family_diff_groups_kernels_by_fusion_kind():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import kernel_breakdown

    a = [{"name": "input_add_reduce_fusion.12", "per_call": 2.0, "us_per_call": 30.0},
         {"name": "input_add_reduce_fusion_3", "per_call": 1.0, "us_per_call": 10.0},
         {"name": "loop_add_fusion", "per_call": 1.0, "us_per_call": 5.0}]
    b = [{"name": "loop_add_fusion.7", "per_call": 4.0, "us_per_call": 32.0}]
    assert kernel_breakdown.family_diff(a, b) == [
        (40.0, "input_add_reduce_fusion", 3.0, 0.0),
        (-27.0, "loop_add_fusion", 1.0, 4.0),
    ]
