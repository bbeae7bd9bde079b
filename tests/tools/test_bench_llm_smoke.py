"""bench/bench_llm.py: the whole run in a subprocess as a user runs it (size tiny, one worker
process per variant; on CPU the device time is reported unavailable, on a GPU it is split by
kernel family), the same parameters for every variant, and the pieces a CPU cannot exercise
on real kernels: the kernel-family rules on GPU kernel names and HLO, the floor arithmetic,
the GPU report and plot."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
from jax_fp8.devtools import hlo

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_llm  # noqa: E402
import llm_kernels  # noqa: E402
import llm_models  # noqa: E402
import llm_report  # noqa: E402

VARIANTS = ("bf16", "jax_fp8_delayed", "jax_fp8_block")


def run_tiny(outdir, env):
    return subprocess.run(
        [sys.executable, "bench/bench_llm.py", "--sizes", "tiny", "--variants", ",".join(VARIANTS),
         "--steps", "2", "--warmup", "1", "--outdir", str(outdir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("bench_llm")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    return run_tiny(outdir, env), outdir


def test_tiny_run_writes_every_figure(tiny_run):
    proc, outdir = tiny_run
    assert proc.returncode == 0, proc.stderr[-5000:]
    data = json.loads((outdir / "results.json").read_text())
    assert not data["partial"] and not data["failures"] and not data["skipped"], data["failures"]
    meta = data["meta"]
    env = meta["environment"]
    assert env["platform"] == "cpu" and env["device"] and env["jax_version"]
    assert meta["date"] and "git_commit" in meta and "bench/bench_llm.py" in meta["command"]
    assert meta["settings"]["steps"] == 2 and meta["settings"]["variants"] == list(VARIANTS)
    assert "bf16's attention" in meta["floor_definition"]
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == list(VARIANTS)
    for v, r in rows.items():
        assert r["size"] == "tiny" and r["config"]["d"] == 128 and r["tokens"] == 128, v
        assert r["device_ms"] is None and "unavailable" in r["device_time_note"], v
        for key in ("pipelined_ms", "blocked_ms", "tokens_per_s", "lower_s", "compile_s",
                    "lower_compile_s", "init_s"):
            assert r[key] > 0, (v, key)
        assert len(r["blocked_ms_all"]) == 2, v
        assert isinstance(r["temp_bytes"], int), v
        assert r["loss_finite"] and r["attention_impl"] == "xla", v
        # The XLA:CPU op time stands in for the family split (every family named).
        assert set(r["cpu_op_families_ms"]) == set(llm_kernels.FAMILIES), v
        assert sum(r["cpu_op_families_ms"].values()) > 0, v
        h = r["hlo"]
        assert h["gemms_fp8"] + h["gemms_other"] >= 2 * (4 * 2 + 1), v   # 4 per block + head
    if jax_fp8.HAS_CPU_KERNEL:
        assert rows["jax_fp8_delayed"]["hlo"]["jax_fp8_update"] == 1
    assert rows["bf16"]["hlo"]["jax_fp8_update"] == 0
    assert rows["jax_fp8_delayed"]["cpu_op_families_ms"]["quantize_transpose"] > 0
    assert rows["bf16"]["cpu_op_families_ms"]["quantize_transpose"] == 0
    per = data["derived"]["tiny"]
    assert per["bf16"]["pipelined_ms:vs_bf16"] == pytest.approx(1.0)
    assert per["jax_fp8_block"]["blocked_ms:vs_bf16"] == pytest.approx(
        rows["bf16"]["blocked_ms"] / rows["jax_fp8_block"]["blocked_ms"])
    assert "floor_ms" not in per["jax_fp8_delayed"]      # no device time, no floor


def test_tiny_run_report_and_plot(tiny_run):
    proc, outdir = tiny_run
    md = (outdir / "results.md").read_text()
    assert md.strip() in proc.stdout
    for text in ("## tiny: d 128, 2 heads, ffn 256, 2 blocks, 2 × 64 tokens",
                 "| variant | device ms | × bf16 | × Flax FP8 | pipelined ms |",
                 "| jax_fp8 delayed |", "Device time: unavailable", "Floor of an FP8 variant"):
        assert text in md, text
    assert "[3/3] tiny jax_fp8_block" in proc.stderr
    assert "\r" not in proc.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in proc.stderr
    else:
        assert (outdir / "plot.png").stat().st_size > 1000
    # OUTDIR holds the report and nothing else (worker files stay in a temporary folder).
    assert set(os.listdir(outdir)) - {"plot.png"} == {"results.json", "results.md"}


@pytest.mark.parametrize("name, family", [
    ("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bx_coopA_TNT", "fp8_gemm"),
    ("nvjet_sm90_rqtst_144x128_128x6_1x2_h_bz_coopA_algo2_TNN", "fp8_gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "fp8_gemm"),
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "bf16_gemm"),
    ("nvjet_sm90_tss_64x256_64x5_2x1_v_bz_TNN", "bf16_gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x128", "fp8_gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_"
     "kernel0_0", "attention"),
    ("void jax_fp8::(anonymous namespace)::QuantizeTransposeKernel<__nv_bfloat16, "
     "(jax_fp8::Fp8Type)1>(__nv_bfloat16 const*, float const*, unsigned int*)", "jax_fp8_kernels"),
    ("jax_fp8::(anonymous namespace)::TransposeBytesKernel(unsigned int const*, unsigned int*, "
     "long, long)", "jax_fp8_kernels"),
    ("void jax_fp8::(anonymous namespace)::BlockGemmFallbackKernel<float>()", "fp8_gemm"),
    ("memcpy32_post", "other"),
])
def test_gpu_kernel_names_by_family(name, family):
    assert llm_kernels.event_family({"name": name, "dur": 1.0}, {})[0] == family


def test_event_family_prefers_the_compiled_hlo():
    families = {"loop_convert_fusion_3": "quantize_transpose", "custom_call_7": "fp8_gemm"}
    assert llm_kernels.event_family({"name": "loop_convert_fusion_3"}, families) == (
        "quantize_transpose", "hlo name")
    # A GEMM kernel whose name says nothing of its operands: the HLO instruction decides.
    assert llm_kernels.event_family({"name": "sm90_gemm_kernel", "args": {"hlo_op": "custom-call.7"}},
                                  families)[0] == "fp8_gemm"
    assert llm_kernels.event_family({"name": "sm90_gemm_kernel"}, families)[0] == "bf16_gemm"


HLO = """HloModule m

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%fused_norm_q (p0: bf16[8,128]) -> f8e4m3fn[8,128] {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %r = bf16[8,128]{1,0} rsqrt(%p0)
  ROOT %c = f8e4m3fn[8,128]{1,0} convert(%r)
}

%fused_act_q (p0: bf16[8,128]) -> f8e4m3fn[8,128] {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %s = bf16[8,128]{1,0} logistic(%p0), metadata={op_name="jit(step)/block0/mlp_out/logistic"}
  ROOT %c = f8e4m3fn[8,128]{1,0} convert(%s), metadata={op_name="jit(step)/mlp_out/proj/convert"}
}

%fused_q (p0: bf16[8,128]) -> f8e5m2[128,8] {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %t = bf16[128,8]{1,0} transpose(%p0), dimensions={1,0}
  ROOT %c = f8e5m2[128,8]{1,0} convert(%t)
}

%fused_amax (p0: bf16[8,128]) -> f32[] {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %x = f32[8,128]{1,0} convert(%p0)
  %ab = f32[8,128]{1,0} abs(%x)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%ab, %z), dimensions={0,1}, to_apply=%max
}

%fused_adam_amax (p0: f32[128,128], p1: f32[128,128]) -> (f32[128,128], bf16[128]) {
  %p0 = f32[128,128]{1,0} parameter(0)
  %p1 = f32[128,128]{1,0} parameter(1)
  %u = f32[128,128]{1,0} add(%p0, %p1), metadata={op_name="jit(step)/add"}
  %w = bf16[128,128]{1,0} convert(%p0), metadata={op_name="jit(step)/jvp(Decoder)/block0/qkv/convert_element_type"}
  %ab = bf16[128,128]{1,0} abs(%w), metadata={op_name="jit(step)/jvp(Decoder)/block0/qkv/abs"}
  %z = bf16[] constant(-inf)
  %r = bf16[128]{0} reduce(%ab, %z), dimensions={1}, to_apply=%max, metadata={op_name="jit(step)/jvp(Decoder)/block0/qkv/reduce_max"}
  ROOT %t = (f32[128,128]{1,0}, bf16[128]{0}) tuple(%u, %r)
}

%fused_amax_bwd (p0: bf16[8,128]) -> (bf16[8,128], f32[]) {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %n = bf16[8,128]{1,0} negate(%p0), metadata={op_name="jit(step)/transpose(jvp(Decoder))/block0/neg"}
  %x = f32[8,128]{1,0} convert(%p0)
  %ab = f32[8,128]{1,0} abs(%x)
  %z = f32[] constant(0)
  %r = f32[] reduce(%ab, %z), dimensions={0,1}, to_apply=%max
  ROOT %t = (bf16[8,128]{1,0}, f32[]) tuple(%n, %r)
}

%fused_add (p0: bf16[8,128], p1: bf16[8,128]) -> bf16[8,128] {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %p1 = bf16[8,128]{1,0} parameter(1)
  ROOT %s = bf16[8,128]{1,0} add(%p0, %p1)
}

ENTRY %main (a: bf16[8,128], w: f8e4m3fn[128,128]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0} parameter(0)
  %w = f8e4m3fn[128,128]{1,0} parameter(1)
  %norm_q.1 = f8e4m3fn[8,128]{1,0} fusion(%a), kind=kLoop, calls=%fused_norm_q
  %act_q.2 = f8e4m3fn[8,128]{1,0} fusion(%a), kind=kLoop, calls=%fused_act_q
  %q.3 = f8e5m2[128,8]{1,0} fusion(%a), kind=kInput, calls=%fused_q
  %amax.4 = f32[] fusion(%a), kind=kInput, calls=%fused_amax
  %att.5 = (bf16[8,128], u8[0]) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
  %g.6 = (bf16[8,128], s8[4]) custom-call(%norm_q.1, %w), custom_call_target="__cublas$lt$matmul$f8"
  %u.7 = f32[2]{0} custom-call(%a), custom_call_target="jax_fp8_update"
  %p.9 = f32[128,128]{1,0} parameter(2)
  %adam.10 = (f32[128,128]{1,0}, bf16[128]{0}) fusion(%p.9, %p.9), kind=kInput, calls=%fused_adam_amax
  %amax.11 = (bf16[8,128]{1,0}, f32[]) fusion(%a), kind=kInput, calls=%fused_amax_bwd
  ROOT %add.8 = bf16[8,128]{1,0} fusion(%a, %a), kind=kLoop, calls=%fused_add
}
"""


def test_hlo_families():
    assert llm_kernels.hlo_families(HLO) == {
        "norm_q_1": "norm_quantize", "act_q_2": "act_quantize", "q_3": "quantize_transpose",
        "amax_4": "amax", "att_5": "attention", "g_6": "fp8_gemm", "u_7": "jax_fp8_kernels",
        "add_8": "other", "adam_10": "optimizer", "amax_11": "amax"}


def test_split_by_family_with_bytes():
    events = [{"name": "adam_10", "dur": 100.0}, {"name": "adam_10", "dur": 100.0},
              {"name": "amax_11", "dur": 50.0},
              {"name": "nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_TNN", "dur": 300.0}]
    families = llm_kernels.hlo_families(HLO)
    ms, how, top, bw = llm_kernels.split_by_family(events, families, 2, 10,
                                                 hlo.kernel_bytes(HLO))
    assert ms["optimizer"] == pytest.approx(0.1) and ms["fp8_gemm"] == pytest.approx(0.15)
    adam = next(k for k in top if k["name"] == "adam_10")
    # adam.10 reads p.9 once (65536 B), writes f32[128,128] and bf16[128].
    assert adam["bytes"] == 65536 + 65536 + 256
    assert adam["tb_per_s"] == pytest.approx(131328 / 100e-6 / 1e12, abs=1e-3)
    assert "bytes" not in next(k for k in top if k["name"].startswith("nvjet"))
    assert bw["optimizer"] == {"tb_per_s": pytest.approx(131328 / 100e-6 / 1e12, abs=1e-3),
                               "of_time": 1.0}
    assert "fp8_gemm" not in bw


def _row(variant, device, **families):
    fam = dict.fromkeys(llm_kernels.FAMILIES, 0.0)
    fam.update(families)
    return {"size": "s", "variant": variant, "device_ms": device, "pipelined_ms": device * 1.01,
            "families_ms": fam}


def test_floor_is_own_gemms_plus_bf16_attention_and_rest():
    rows = [_row("bf16", 100.0, bf16_gemm=70.0, attention=10.0, other=20.0),
            _row("flax_fp8", 80.0, fp8_gemm=40.0, bf16_gemm=5.0, attention=10.0, other=25.0),
            _row("jax_fp8_delayed", 75.0, fp8_gemm=38.0, bf16_gemm=5.0, attention=9.0,
                 quantize_transpose=3.0, other=20.0)]
    per = llm_report.derive(rows)["s"]
    d = per["jax_fp8_delayed"]
    assert d["floor_ms"] == pytest.approx(43.0 + 10.0 + 20.0)
    assert d["floor_vs_bf16"] == pytest.approx(100.0 / 73.0)
    assert d["floor_over_device"] == pytest.approx(73.0 / 75.0)
    assert d["overhead_ms"] == pytest.approx((75.0 - 43.0 - 9.0) - 20.0)
    assert d["device_ms:vs_bf16"] == pytest.approx(100.0 / 75.0)
    assert d["device_ms:vs_flax"] == pytest.approx(80.0 / 75.0)
    assert d["pipelined_over_device"] == pytest.approx(1.01)
    assert "floor_ms" not in per["bf16"]


def test_report_and_plot_of_gpu_rows(tmp_path):
    """The GPU-only parts of the report (family and floor tables) and of the plot."""
    rows = [_row("bf16", 100.0, bf16_gemm=70.0, attention=10.0, other=20.0),
            _row("jax_fp8_delayed", 75.0, fp8_gemm=38.0, bf16_gemm=5.0, attention=9.0,
                 quantize_transpose=3.0, other=20.0)]
    for r in rows:
        r.update(label=r["variant"], config=dataclasses.asdict(llm_models.SIZES["8b_slice"]),
                 blocked_ms=r["device_ms"] * 1.02, lower_compile_s=5.0, temp_bytes=2 ** 30,
                 tokens_per_s=1e5, model_tflops_device=500.0)
    meta = {"settings": {"steps": 10, "warmup": 3, "history_len": 1024, "fp8_lm_head": False,
                         "scan": False}, "environment": {"device": "NVIDIA H200"},
            "command": "python bench/bench_llm.py", "total_s": 1.0}
    rows[1]["families_bandwidth"] = {"optimizer": {"tb_per_s": 4.04, "of_time": 0.98}}
    data = {"meta": meta, "results": rows, "derived": llm_report.derive(rows), "failures": [],
            "skipped": []}
    md = llm_report.markdown(data)
    assert "| variant | optimizer |\n|---|---:|\n| jax_fp8_delayed | 4.04 (98 %) |" in md
    assert "# Decoder train step — NVIDIA H200" in md
    assert ("| jax_fp8_delayed | 38.000 | 5.000 | 9.000 | 0.000 | 0.000 | 3.000 | 0.000 | 0.000 "
            "| 0.000 | 20.000 | 75.000 |") in md
    assert ("| jax_fp8_delayed | 43.000 | 9.000 | 23.000 | 73.000 | 1.370 | 0.973 | +3.000 | "
            "500 |") in md
    assert "| jax_fp8_delayed | 75.00 | 1.333 | — | 75.75 |" in md
    pytest.importorskip("matplotlib")
    assert llm_report.plot(data, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 1000


@pytest.mark.gpu
def test_tiny_run_on_a_gpu_splits_device_time_by_family(tmp_path):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = run_tiny(tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert not data["failures"], data["failures"]
    rows = {r["variant"]: r for r in data["results"]}
    for v, r in rows.items():
        fam = r["families_ms"]
        assert r["device_ms"] > 0 and r["attention_impl"] == "cudnn", v
        # each family is rounded to 1e-5 ms in results.json
        assert sum(fam.values()) == pytest.approx(r["device_ms"], abs=1e-5 * len(fam)), v
        assert fam["attention"] > 0 and fam["other"] < r["device_ms"], (v, fam)
        # Nearly every kernel is named by the compiled HLO or by a library kernel rule.
        assert r["classified_by"].get("unmatched", 0) <= 0.1 * sum(r["classified_by"].values()), v
    assert rows["bf16"]["families_ms"]["fp8_gemm"] == 0
    assert rows["bf16"]["families_ms"]["bf16_gemm"] > 0
    for v in ("jax_fp8_delayed", "jax_fp8_block"):
        assert rows[v]["families_ms"]["fp8_gemm"] > 0, v
        assert data["derived"]["tiny"][v]["floor_ms"] > 0, v
    assert rows["jax_fp8_delayed"]["families_ms"]["jax_fp8_kernels"] > 0   # the fused update


def test_every_variant_starts_from_the_same_parameters():
    args = bench_llm.build_parser().parse_args(["--attention", "xla"])
    size = llm_models.SIZES["tiny"]
    tokens = jnp.zeros((size.batch, size.seq), jnp.int32)
    params = {}
    with jax.default_device(jax.devices("cpu")[0]):
        for name in ("bf16", "flax_fp8", "jax_fp8_delayed", "jax_fp8_block"):
            p = llm_models.make_state(llm_models.VARIANTS[name], size, args, tokens).params
            params[name] = p["params"] if name == "flax_fp8" else p
    base = params.pop("bf16")
    # Per block 2 norm scales and 4 kernels; the embedding, the final norm, the LM head.
    assert len(jax.tree.leaves(base)) == size.layers * 6 + 3
    for name, p in params.items():
        assert jax.tree.structure(p) == jax.tree.structure(base), name
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(p)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


# Projection weights per block of each architecture the benchmark converts with fp8_model.
CONVERTED_ARCHS = {"gemma3_tiny": ("q_einsum", "kv_einsum", "attn_vec_einsum",
                                   "gating_einsum", "mlp_out"),
                   "qwen3_tiny": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "mlp_out")}


@pytest.mark.parametrize("size_name", sorted(CONVERTED_ARCHS))
def test_a_converted_architecture_trains_with_fp8_projections(size_name):
    """gemma3 / qwen3 are written without FP8 and converted by fp8_model: the same
    parameters as bf16, one FP8 state per projection (delayed), FP8 GEMMs in the compiled
    step, and one fused update; the LM head (tied in gemma3) stays bf16."""
    args = bench_llm.build_parser().parse_args(["--attention", "xla", "--min-fp8-flops", "0"])
    size = llm_models.SIZES[size_name]
    tokens = jnp.zeros((size.batch, size.seq), jnp.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        base = llm_models.make_state(llm_models.VARIANTS["bf16"], size, args, tokens)
        state = llm_models.make_state(llm_models.VARIANTS["jax_fp8_delayed"], size, args,
                                      tokens)
        assert len(jax.tree.leaves(base.params)) == len(jax.tree.leaves(state.params))
        for a, b in zip(jax.tree.leaves(base.params), jax.tree.leaves(state.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        meta = jax_fp8.unpack_states(state.fp8)
        for i in range(size.layers):
            assert sorted(meta[f"layer_{i}"]) == sorted(CONVERTED_ARCHS[size_name]), meta
        step = jax.jit(llm_models.step_function(llm_models.VARIANTS["jax_fp8_delayed"]))
        lowered = step.lower(state, tokens, tokens)
        # XLA:CPU widens FP8 operands before its dots: the FP8 GEMMs are read before that.
        fp8_dots = [ln for ln in lowered.as_text().splitlines()
                    if "dot_general" in ln and "f8E4M3FN" in ln]
        assert fp8_dots
        compiled = lowered.compile()
        assert hlo.custom_calls(hlo.parse(compiled.as_text())).get("jax_fp8_update") == 1
        new, loss = compiled(state, tokens, tokens)
        assert np.isfinite(float(loss))


@pytest.mark.parametrize("piece", sorted(llm_models.XLA_PIECES))
def test_a_piece_handed_to_xla_gives_the_same_bits(piece, monkeypatch):
    """The variants that hand one piece of jax_fp8's layout work back to XLA replace a
    library function that exists, and on the CPU the FP8 Dense gradient keeps its bits.
    (On a GPU the other program may also get other GEMM algorithms and fusions from XLA:
    the gradient-cast variant's input gradient differed in its last bits on an H200.
    The kernels' own bits are tests/kernels/test_layout_kernels.py's.) The loss's cotangent is a
    bfloat16 value computed in float32 (exact in both), so XLA's excess precision, which
    lets a fused cast read a gradient's unrounded float32 value, has nothing to change."""
    module_name, name, replacement = llm_models.XLA_PIECES[piece]
    module = __import__(module_name, fromlist=[name])
    dn = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(0)
    weights = np.asarray(jnp.asarray(rng.normal(size=(64, 96)), jnp.bfloat16)).astype(np.float32)

    def loss(x, w, m):
        y, _ = jax_fp8.fp8_dot_general(x, w, dn, m)
        return jnp.sum(y.astype(jnp.float32) * weights)

    args = (jnp.asarray(rng.normal(size=(64, 128)), jnp.bfloat16),
            jnp.asarray(rng.normal(size=(128, 96)), jnp.float32), jax_fp8.Fp8Meta.create())
    args = jax.device_put(args, jax.devices("cpu")[0])
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    monkeypatch.setattr(module, name, replacement)   # as llm_models.hand_to_xla does
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # hand_to_xla finds the function it replaces
    monkeypatch.setattr(module, name, getattr(module, name))
    llm_models.hand_to_xla(piece)
    assert getattr(module, name) is replacement


def test_gemm_table_attributes_kernels_to_the_gemm_their_event_names():
    """Two traced steps of three GEMM kernels: TFLOP/s = 2 B M N K per call / its time;
    a GEMM kernel whose event names no GEMM of the program is counted apart."""
    kind = "__cublas$lt$matmul$f8"
    gemms = {"custom_call_3": {"fp8": True, "kind": kind, "role": "forward", "batch": 1,
                               "m": 8192, "n": 4096, "k": 4096},
             "custom_call_7": {"fp8": True, "kind": kind, "role": "backward", "batch": 1,
                               "m": 4096, "n": 4096, "k": 8192}}
    events = []
    for _ in range(2):
        events += [
            {"name": "nvjet_sm90_qqtst_128x160", "dur": 500.0, "args": {"hlo_op": "custom-call.3"}},
            {"name": "nvjet_sm90_qrtst_128x160", "dur": 250.0, "args": {"hlo_op": "custom-call.7"}},
            {"name": "nvjet_sm90_tst_128x256", "dur": 100.0, "args": {"hlo_op": "command_buffer"}},
            {"name": "loop_add_fusion", "dur": 40.0, "args": {"hlo_op": "loop_add_fusion"}}]
    table = llm_kernels.gemm_table(events, gemms, steps=2)
    flops = 2 * 8192 * 4096 * 4096
    assert table["rows"] == [
        {"fp8": True, "kind": kind, "role": "forward", "dtypes": [], "batch": 1, "m": 8192, "n": 4096,
         "k": 4096, "per_step": 1, "ms_per_step": 0.5, "tflops": pytest.approx(flops / 500e-6 / 1e12)},
        {"fp8": True, "kind": kind, "role": "backward", "dtypes": [], "batch": 1, "m": 4096, "n": 4096,
         "k": 8192, "per_step": 1, "ms_per_step": 0.25, "tflops": pytest.approx(flops / 250e-6 / 1e12)}]
    assert table["unattributed_ms"] == 0.1


def test_time_fp8_gemm_alone_runs_the_gemm_of_a_row():
    """On the CPU there are no GPU kernels to time (None); a batched row or one whose
    operands are not FP8 is not timed."""
    row = {"fp8": True, "kind": "__cublas$lt$matmul$f8", "role": "backward",
           "dtypes": ["f8e5m2", "f8e4m3fn"], "batch": 1, "m": 64, "n": 32, "k": 128}
    with jax.default_device(jax.devices("cpu")[0]):
        got = llm_kernels.time_fp8_gemm_alone(row, steps=2)
    assert got == {"tflops": None, "tflops_other_accumulation": None}
    assert llm_kernels.time_fp8_gemm_alone(dict(row, batch=2), steps=2) == {}
    assert llm_kernels.time_fp8_gemm_alone(dict(row, dtypes=["bf16", "bf16"]), steps=2) == {}
    assert llm_kernels.time_fp8_gemm_alone(dict(row, kind="jax_fp8_block_gemm"), steps=2) == {}


def test_gemm_table_falls_back_to_program_order():
    """Kernels from a command buffer name no HLO op: with one GEMM kernel per GEMM of the
    program per step, the kernels in time order are the GEMMs in program order, unless a
    kernel's name disagrees with its GEMM on FP8 (then nothing is attributed)."""
    kind = "__cublas$lt$matmul$f8"
    gemms = {"custom_call_3": {"fp8": True, "kind": kind, "role": "forward", "batch": 1,
                               "m": 8192, "n": 4096, "k": 4096},
             "custom_call_9": {"fp8": False, "kind": "__cublas$lt$matmul", "role": "forward",
                               "batch": 1, "m": 8192, "n": 32000, "k": 4096}}
    events = []
    for step in range(2):
        t = 1000.0 * step
        events += [
            {"name": "nvjet_sm90_tst_128x256", "ts": t + 600, "dur": 300.0, "args": {}},
            {"name": "loop_add_fusion", "ts": t + 550, "dur": 40.0, "args": {}},
            {"name": "void jax_fp8::(anonymous namespace)::QuantizeTransposeKernel<"
                     "__nv_bfloat16, (jax_fp8::Fp8Type)1>", "ts": t + 560, "dur": 30.0,
             "args": {}},
            {"name": "nvjet_sm90_qqtst_128x160", "ts": t, "dur": 500.0, "args": {}}]
    table = llm_kernels.gemm_table(events, gemms, steps=2)
    assert table["attributed_by"] == "order"
    assert [(r["fp8"], r["n"], r["per_step"], r["ms_per_step"]) for r in table["rows"]] == [
        (True, 4096, 1, 0.5), (False, 32000, 1, 0.3)]
    assert table["unattributed_ms"] == 0
    swapped = [dict(e, ts=-e["ts"]) for e in events]   # bf16 kernel first: names disagree
    table = llm_kernels.gemm_table(swapped, gemms, steps=2)
    assert table["rows"] == [] and table["attributed_by"] is None
    assert table["unattributed_ms"] == 0.8
    assert llm_kernels.gemm_table(events[:-1], gemms, steps=2)["rows"] == []   # counts differ


# The shapes measured (bench/llm_models.py SIZES, two layers of each): which projections
# the default rules (min_fp8_flops="auto") keep out of FP8, forward GEMMs, per recipe.
AUTO_FP8 = {
    ("gemma3_1b", "jax_fp8_delayed"): {"gating_einsum", "mlp_out/proj"},
    ("gemma3_1b", "jax_fp8_block"): {"gating_einsum"},
    ("qwen3_1.7b", "jax_fp8_delayed"): {"q_proj", "o_proj", "gate_proj", "up_proj",
                                        "mlp_out/proj"},
    ("qwen3_1.7b", "jax_fp8_block"): {"gate_proj", "up_proj", "mlp_out/proj"},
}


@pytest.mark.parametrize("size_name, variant", sorted(AUTO_FP8))
def test_default_rules_convert_the_gemms_that_pay(size_name, variant):
    """Traced only (jax_fp8.devtools.explain of the forward pass on abstract arguments):
    the projections with at least the recipe's AUTO_MIN_FP8_FLOPS are FP8, the rest kept."""
    from jax_fp8.devtools import explain
    args = bench_llm.build_parser().parse_args(["--attention", "xla"])
    size = dataclasses.replace(llm_models.SIZES[size_name], layers=2)
    model = llm_models.make_model(llm_models.VARIANTS[variant], size, args)
    tokens = jax.ShapeDtypeStruct((size.batch, size.seq), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    rows = explain.explain(model.apply, variables, tokens)
    block = variant == "jax_fp8_block"
    fp8 = {r.where for r in rows if (r.name == "jax_fp8_block_gemm" if block
                                     else r.kind == "gemm" and r.lowering == "fp8")}
    kept = {r.where for r in rows if r.kind == "gemm" and "min_fp8_flops" in r.why}
    layer = lambda where: where.split("/layer_0/", 1)[1].rsplit("/", 1)[0]  # noqa: E731
    assert {layer(w) for w in fp8 if "/layer_0/" in w} == AUTO_FP8[size_name, variant]
    assert kept and not {layer(w) for w in kept if "/layer_0/" in w} & AUTO_FP8[size_name,
                                                                                  variant]
