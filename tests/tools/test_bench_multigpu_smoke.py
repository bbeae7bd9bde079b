"""CPU smoke test of bench/bench_multigpu.py (--smoke: one block, d = 64, 64 tokens) on 4
host devices, run as a user runs it, in a subprocess (the pytest process may already hold
a 1-device jax): data-parallel, FSDP (on a 2 x 2 mesh) and tensor-parallel steps of bf16
and jax_fp8. Flax FP8 is left out here for time; the full bench runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jax_fp8

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository
MODES, VARIANTS = ("dp", "fsdp", "tp"), ("bf16", "jax_fp8")
FP8 = {"f8e4m3fn", "f8e5m2"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_multigpu")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    proc = subprocess.run([sys.executable, "bench/bench_multigpu.py", "--smoke", "--variants",
                           ",".join(VARIANTS), "--mesh", "fsdp=2x2", "--outdir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    results = out / "results.json"
    data = json.loads(results.read_text()) if results.exists() else None
    return proc, data, out


def _row(data, mode, variant):
    (r,) = [r for r in data["results"] if (r["mode"], r["variant"]) == (mode, variant)]
    return r


@pytest.mark.skipif(not jax_fp8.HAS_CPU_KERNEL,
                    reason="jax_fp8's CPU kernel not built (the jax_fp8 steps are checked to "
                           "hold one jax_fp8_update custom call)")
class TestSmoke:
    def test_runs_every_mode_and_variant(self, bench):
        proc, data, out = bench
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert "\r" not in proc.stderr          # a log gets lines, never carriage returns
        assert not data["partial"] and not data["failures"], data["failures"]
        assert data["meta"]["device_count"] == 4 and data["meta"]["nccl_nvls_enable"] == "0"
        assert data["meta"]["settings"]["meshes"] == {"dp": [4], "fsdp": [2, 2], "tp": [2, 2]}
        assert {(r["mode"], r["variant"]) for r in data["results"]} == {
            (m, v) for m in MODES for v in VARIANTS}
        for r in data["results"]:
            for key in ("compile_s", "device_ms", "busy_ms", "pipelined_ms", "blocked_ms"):
                assert r[key] > 0, (r["mode"], r["variant"], key)
            assert r["devices_in_trace"] == 4 and r["loss_finite"]
        md = (out / "results.md").read_text()
        assert md.strip() in proc.stdout
        for text in ("## dp: mesh data 4", "## fsdp: mesh data 2 × fsdp 2",
                     "## tp: mesh data 2 × model 2", "| jax_fp8 (Fp8TrainState, packed) |",
                     "| amax all-reduce |"):
            assert text in md, text
        assert "[6/6]" in proc.stderr

    def test_replicas_bit_identical(self, bench):
        _, data, _ = bench
        for r in data["results"]:
            rep = r["replicas"]
            assert rep["bit_identical"] and not rep["mismatched"], (r["mode"], r["variant"], rep)
            assert rep["replicated_leaves"] > 0
        # dp: everything replicated; fsdp, tp: the 12 kernel leaves (params, mu, nu) split.
        assert _row(data, "dp", "jax_fp8")["sharded_leaves"] == 0
        assert _row(data, "fsdp", "jax_fp8")["sharded_leaves"] == 12
        assert _row(data, "tp", "jax_fp8")["sharded_leaves"] == 12

    @pytest.mark.parametrize("mode", MODES)
    def test_jax_fp8_one_amax_all_reduce_and_one_update(self, bench, mode):
        _, data, _ = bench
        r = _row(data, mode, "jax_fp8")
        assert r["all_reduce_kinds"].get("maximum") == 1, r["all_reduce_kinds"]
        assert r["hlo"]["jax_fp8_update"] == 1
        assert "maximum" not in _row(data, mode, "bf16")["all_reduce_kinds"]
        # Every amax crosses every device of the mesh (one set of replica groups for all).
        (amax,) = [c for c in r["collective_list"] if c["kind"] == "amax all-reduce"]
        assert amax["axes"] == list(r["mesh"]), amax

    def test_fsdp_weight_all_gathers_are_fp8_and_half_of_bf16s(self, bench):
        _, data, _ = bench
        fp8 = _row(data, "fsdp", "jax_fp8")["weight_all_gathers"]
        bf16 = _row(data, "fsdp", "bf16")["weight_all_gathers"]
        # bf16: one gather per Dense kernel, kept from the forward for the backward.
        # jax_fp8: the forward's gather of each FP8 kernel, and one more of the FP8 shard
        # saved for the backward (the custom VJPs save their residuals as integers, which
        # remat policies leave alone) for each input gradient the step computes: three of
        # the four layers (the first layer's input needs none). In bytes, 5/6 of bf16's.
        assert bf16["count"] == 4 and fp8["count"] == 4 + 3, (fp8, bf16)
        assert set(fp8["dtypes"]) <= FP8 and set(bf16["dtypes"]) == {"bf16"}, (fp8, bf16)
        assert 6 * fp8["bytes"] == 5 * bf16["bytes"], (fp8, bf16)
        assert data["derived"]["fsdp"]["jax_fp8"]["weight_gather_bytes_over_bf16"] == 5 / 6
        for c in _row(data, "fsdp", "jax_fp8")["partitioned_collective_list"]:
            if c["kind"] == "weight all-gather":
                assert c["axes"] == ["fsdp"], c          # gathered over the fsdp axis only

    def test_tp_sums_partial_outputs_over_model(self, bench):
        _, data, _ = bench
        for v in VARIANTS:
            r = _row(data, "tp", v)
            kinds = {(c["kind"], tuple(c["axes"])) for c in r["partitioned_collective_list"]}
            assert ("tp all-reduce (activations)", ("model",)) in kinds, kinds
            assert ("gradient all-reduce", ("data",)) in kinds, kinds
            # Megatron layout: no resharding between in3 and out, no weight gathers.
            assert {c["opcode"] for c in r["partitioned_collective_list"]} == {"all-reduce"}
            assert r["collective_ms"].get("tp all-reduce (activations)", 0) > 0

    def test_ratios_vs_bf16(self, bench):
        _, data, _ = bench
        for mode in MODES:
            per = data["derived"][mode]
            assert per["bf16"]["device_ms:vs_bf16"] == pytest.approx(1.0)
            r, base = _row(data, mode, "jax_fp8"), _row(data, mode, "bf16")
            assert per["jax_fp8"]["pipelined_ms:vs_bf16"] == pytest.approx(
                base["pipelined_ms"] / r["pipelined_ms"])
