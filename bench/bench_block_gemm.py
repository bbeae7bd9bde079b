"""Block-scaled FP8 GEMM kernels alone, shape by shape: each compiled CUTLASS configuration,
cuBLASLt's block-scaled GEMM and XLA's per-tensor FP8 GEMM, in TFLOP/s of GPU kernel time.

The shapes are the FP8 GEMMs of bench_llm.py's decoders (``--sizes``, default the 8B layer
slice and ~1B, M = 8192 tokens): per layer the fused QKV, attention-out, fused gate/up and
down projections, each as the forward (``a`` [tokens, in] in 1x128 blocks times the
weight [out, in] in 128x128 tiles, bf16 out), the data gradient ([tokens, out] x
[in, out] tiles, bf16 out) and the weight gradient ([in, tokens] x [out, tokens], both in
1x128 blocks along the tokens, float32 out), as jax_fp8's block recipe calls them
(scales already in the GEMM's layout, so the custom call is the only work). Per-tensor
FP8 is ``jax_fp8.gemm._gemms.gemm`` (cuBLASLt through XLA, autotuned) with fast accumulation
("fast") and with float32 accumulation ("f32acc"), at the same shapes and output types
(its GEMM kernel's time alone).

Times: the sum of the GPU kernels' durations in a profiler trace of ``--steps`` calls.
Each block-scaled kernel's output is compared with cuBLASLt's (``max |x - y| / max |y|``,
a sanity check; tests/kernels/test_block_gemm.py holds the error bound).

``--sanitize``: instead, every configuration once on small ragged GEMMs, for
compute-sanitizer. ``--clocks``: instead, one per-tensor FP8 GEMM in a 10-call burst, then a
sustained loop (``--sustain`` seconds), timed in chunks while ``nvidia-smi`` samples the SM
clock, power and temperature every 100 ms: whether the clock drops under sustained load.

Writes ``block_gemm.json`` and ``block_gemm.md`` (or ``clocks.json`` / ``clocks.md``)
under ``--outdir``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8._primitives import (
    block_gemm as bg,  # noqa: E402
    block_quantize as bq,  # noqa: E402
)
from jax_fp8.devtools import trace  # noqa: E402
from jax_fp8.gemm import _gemms  # noqa: E402
from llm_models import SIZES  # noqa: E402

E4M3 = jnp.float8_e4m3fn
NT = (((1,), (1,)), ((), ()))


def layer_gemms(size):
    """[(layer, role, M, N, K, b_tile, out dtype)] of one decoder layer (see the module doc)."""
    s = SIZES[size]
    t, d = s.tokens, s.d
    projections = [("qkv", d, 3 * d), ("attn_out", d, d), ("mlp_in", d, 2 * s.ffn),
                   ("mlp_out", s.ffn, d)]
    rows = []
    for name, fan_in, fan_out in projections:
        rows.append((name, "forward", t, fan_out, fan_in, True, jnp.bfloat16))
        rows.append((name, "dgrad", t, fan_in, fan_out, True, jnp.bfloat16))
        rows.append((name, "wgrad", fan_in, fan_out, t, False, np.float32))
    return rows


def operand(rng, rows, k, block_rows):
    """Random E4M3 [rows, k] (normal values, no zeros) and scale_inv in the GEMM layout."""
    q = jnp.asarray(rng.normal(size=(rows, k)).astype(np.float32) * 16).astype(E4M3)
    shape = bq.scale_shape((rows, k), block_rows, "gemm")
    s = jnp.asarray(np.exp2(rng.integers(-3, 4, size=shape)).astype(np.float32))
    return q, s


GEMM_KERNEL = re.compile(r"nvjet|cublas|cutlass|xmma|gemm|matmul", re.I)


def device_us(fn, args, steps, gemm_only=False):
    """GPU kernel time of one call: the trace's device events over `steps` calls (only the
    GEMM kernels' with `gemm_only`)."""
    out = fn(*args)
    jax.block_until_ready(out)
    _, events = trace.capture(lambda c: (c[0], fn(*c[0])), (args, out), steps=steps)
    events = trace.device_events(events, platform="gpu")
    if gemm_only:
        events = [e for e in events if GEMM_KERNEL.search(str(e.get("name", "")))]
    return trace.total_us(events) / steps


def block_call(kernel, b_rows, out_dtype):
    return jax.jit(functools.partial(bg._ffi_gemm, a_block_rows=1, b_block_rows=b_rows,
                                     out_dtype=out_dtype, scale_layout="gemm", kernel=kernel))


def per_tensor_call(out_dtype, precision):
    one = jnp.float32(1)
    return jax.jit(lambda a, b, *_: _gemms.gemm(a, b, NT, one, one, out_dtype,
                                                precision=precision))


def measure(sizes, steps, configs, kernels=None, per_tensor=True):
    rng = np.random.default_rng(0)
    rows, seen = [], {}
    for size in sizes:
        for layer, role, m, n, k, b_tile, out_dtype in layer_gemms(size):
            key = (m, n, k, b_tile, np.dtype(out_dtype).name)
            row = {"size": size, "layer": layer, "role": role, "m": m, "n": n, "k": k,
                   "b": "128x128" if b_tile else "1x128", "out": np.dtype(out_dtype).name,
                   "tflops": {}, "rel_diff": {}}
            if key in seen:  # the same GEMM in another row: reuse its numbers
                row.update({"tflops": seen[key]["tflops"], "rel_diff": seen[key]["rel_diff"]})
                rows.append(row)
                continue
            b_rows = 128 if b_tile else 1
            a, sa = operand(rng, m, k, 1)
            b, sb = operand(rng, n, k, b_rows)
            args = (a, sa, b, sb)
            flops = 2.0 * m * n * k
            want = None
            names = ["cublaslt", "auto"] + [c for c, ct, cb in configs
                                            if ct == b_tile and cb == (out_dtype == jnp.bfloat16)]
            names = [c for c in names if kernels is None or c in kernels]
            for name in names:
                fn = block_call(name, b_rows, out_dtype)
                try:
                    got = np.asarray(fn(*args), np.float32)
                except Exception as err:  # noqa: BLE001 - recorded, the table shows it
                    row["tflops"][name] = None
                    row["rel_diff"][name] = f"{type(err).__name__}: {err}"[:200]
                    continue
                if want is None:
                    want = got
                scale = float(np.abs(want).max()) or 1.0
                row["rel_diff"][name] = float(np.abs(got - want).max()) / scale
                row["tflops"][name] = flops / device_us(fn, args, steps) / 1e6
                del got
            for name, precision in (("per_tensor_fast", None),
                                    ("per_tensor_f32acc", jax.lax.Precision.HIGHEST))[
                                        :2 if per_tensor else 0]:
                fn = per_tensor_call(out_dtype, precision)
                row["tflops"][name] = flops / device_us(fn, (a, b), steps, gemm_only=True) / 1e6
            seen[key] = row
            rows.append(row)
            print(f"{size:9s} {layer:9s} {role:8s} {m:6d} {n:6d} {k:6d} "
                  + " ".join(f"{k_}={v:.0f}" for k_, v in row["tflops"].items() if v),
                  flush=True)
            del a, sa, b, sb, args, want
    return rows


def table(rows, configs):
    tile_cfgs = [c for c, ct, _ in configs if ct]
    block_cfgs = [c for c, ct, _ in configs if not ct]
    cols = ["cublaslt", "auto"] + tile_cfgs + block_cfgs + ["per_tensor_fast",
                                                             "per_tensor_f32acc"]
    cols = [c for c in cols if any(c in r["tflops"] for r in rows)]
    head = ("| size | layer | GEMM | M | N | K | " + " | ".join(cols) + " | best block / "
            "cuBLASLt | best block / per-tensor f32acc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["tflops"]
        cells = [f"{t[c]:.0f}" if t.get(c) else ("err" if c in t else "") for c in cols]
        block = [v for c, v in t.items() if c not in ("auto", "per_tensor_fast",
                                                      "per_tensor_f32acc") and v]
        best = max(block) if block else None
        ratio = lambda x, best=best: f"{best / x:.2f}" if best and x else ""  # noqa: E731
        lines.append(f"| {r['size']} | {r['layer']} | {r['role']} | {r['m']} | {r['n']} | "
                     f"{r['k']} | " + " | ".join(cells)
                     + f" | {ratio(t.get('cublaslt'))} | {ratio(t.get('per_tensor_f32acc'))} |")
    return "\n".join(lines) + "\n"


def sanitize():
    """Every compiled configuration once on a small ragged GEMM (and the handler's own
    choice), against cuBLASLt: a short run for compute-sanitizer."""
    module = __import__("jax_fp8._jax_fp8_cuda", fromlist=["cutlass_configs"])
    rng = np.random.default_rng(2)
    n_calls = 0
    for name, b_tile, bf16 in [("auto", True, True), ("auto", False, False)] + [
            tuple(c) for c in module.cutlass_configs()]:
        out_dtype = jnp.bfloat16 if bf16 else np.float32
        b_rows = 128 if b_tile else 1
        for lead, m, n, k in (((), 200, 136, 400), ((2,), 64, 264, 272)):
            a, sa = operand(rng, m, k, 1)
            b, sb = operand(rng, n, k, b_rows)
            if lead:
                a, sa, b, sb = (jnp.stack([x] * lead[0]) for x in (a, sa, b, sb))
            got = np.asarray(block_call(name, b_rows, out_dtype)(a, sa, b, sb), np.float32)
            want = np.asarray(block_call("cublaslt", b_rows, out_dtype)(a, sa, b, sb),
                              np.float32)
            diff = float(np.abs(got - want).max()) / float(np.abs(want).max())
            assert diff < 2.0 ** -7, (name, m, n, k, diff)
            n_calls += 1
    print(f"sanitize: {n_calls} block GEMM calls agree with cuBLASLt")


def clocks(outdir, seconds, shape=(8192, 28672, 4096)):
    """A 10-call burst then a sustained loop of one per-tensor FP8 GEMM, with nvidia-smi
    sampling clocks, power and temperature every 100 ms."""
    m, n, k = shape
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32) * 16).astype(E4M3)
    b = jnp.asarray(rng.normal(size=(n, k)).astype(np.float32) * 16).astype(E4M3)
    fn = per_tensor_call(jnp.bfloat16, None)
    jax.block_until_ready(fn(a, b))
    flops = 2.0 * m * n * k
    log = os.path.join(outdir, "smi.csv")
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
         "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=open(log, "w"), stderr=subprocess.DEVNULL)
    t0 = time.time()
    chunks = []

    def chunk(phase, calls):
        start = time.time()
        out = None
        for _ in range(calls):
            out = fn(a, b)
        jax.block_until_ready(out)
        end = time.time()
        chunks.append({"phase": phase, "t0": start - t0, "t1": end - t0, "calls": calls,
                       "tflops": flops * calls / (end - start) / 1e12})

    try:
        time.sleep(2.0)
        chunk("burst", 10)
        time.sleep(3.0)
        while time.time() - t0 < 5.0 + seconds:
            chunk("sustained", 40)
        time.sleep(2.0)
    finally:
        smi.terminate()
        smi.wait()
    samples = []
    for rec in csv.reader(io.StringIO(open(log).read())):
        if len(rec) < 4:
            continue
        try:
            samples.append({"clock_mhz": float(rec[1]), "power_w": float(rec[2]),
                            "temp_c": float(rec[3]), "stamp": rec[0].strip()})
        except ValueError:
            continue
    data = {"shape": shape, "chunks": chunks, "samples": samples,
            "device": str(jax.devices()[0].device_kind)}
    with open(os.path.join(outdir, "clocks.json"), "w") as fp:
        json.dump(data, fp, indent=1)
    sus = [c["tflops"] for c in chunks if c["phase"] == "sustained"]
    burst = [c["tflops"] for c in chunks if c["phase"] == "burst"]
    busy = [s for s in samples if s["power_w"] > 200]
    text = (f"burst (10 calls): {burst[0]:.0f} TFLOP/s; sustained ({len(sus)} chunks of 40, "
            f"{seconds:.0f} s): first {sus[0]:.0f}, median {np.median(sus):.0f}, last "
            f"{sus[-1]:.0f}, min {min(sus):.0f} TFLOP/s\n")
    if busy:
        clk = [s["clock_mhz"] for s in busy]
        pw = [s["power_w"] for s in busy]
        text += (f"under load ({len(busy)} samples, power > 200 W): SM clock min {min(clk):.0f} "
                 f"median {np.median(clk):.0f} max {max(clk):.0f} MHz; power median "
                 f"{np.median(pw):.0f} max {max(pw):.0f} W; temperature "
                 f"{busy[0]['temp_c']:.0f} -> {busy[-1]['temp_c']:.0f} C\n")
    with open(os.path.join(outdir, "clocks.md"), "w") as fp:
        fp.write(text)
    print(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8b_slice,1b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--outdir", default="bench/results/block_gemm")
    p.add_argument("--clocks", action="store_true")
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--kernels", default=None,
                   help="comma-separated: cublaslt, auto, CUTLASS configuration names")
    p.add_argument("--no-per-tensor", action="store_true")
    p.add_argument("--sustain", type=float, default=12.0)
    args = p.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    if args.clocks:
        clocks(args.outdir, args.sustain)
        return
    if args.sanitize:
        sanitize()
        return
    module = __import__("jax_fp8._jax_fp8_cuda", fromlist=["cutlass_configs"])
    configs = [tuple(c) for c in module.cutlass_configs()]
    print("cutlass:", bg.cutlass_status(), "cublaslt:", bg.cublas_status(), flush=True)
    kernels = args.kernels.split(",") if args.kernels else None
    rows = measure(args.sizes.split(","), args.steps, configs, kernels, not args.no_per_tensor)
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "steps": args.steps, "configs": configs,
            "command": "python bench/bench_block_gemm.py " + " ".join(argv or sys.argv[1:])}
    with open(os.path.join(args.outdir, "block_gemm.json"), "w") as fp:
        json.dump({"meta": meta, "rows": rows}, fp, indent=1)
    text = table(rows, configs)
    with open(os.path.join(args.outdir, "block_gemm.md"), "w") as fp:
        fp.write(text)
    print(text)


if __name__ == "__main__":
    main()
