#!/usr/bin/env python3
"""Benchmark: one Dense layer's forward + backward, bf16 against each FP8 recipe, over sizes.

Where does FP8 start to pay? For x [T, d_in] . w [d_in, d_out] (a train step's three
GEMMs: forward, input gradient, kernel gradient, plus each recipe's quantization and
bookkeeping), device time per step from a profiler trace (sum of GPU kernel durations /
steps), for bf16 and for jax_fp8 with delayed, current and blockwise scaling. The
ratio bf16 / FP8 per size gives the GEMM size above which each recipe is faster.

    python bench/bench_dense.py --outdir out/bench_dense          # the default grid
    python bench/bench_dense.py --sizes 1024x1024x4096 --steps 5  # T x d_in x d_out
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8.devtools import trace

DN = (((1,), (0,)), ((), ()))
RECIPES = {
    "delayed": jax_fp8.DelayedScaling(history_len=16),
    "current": jax_fp8.Float8CurrentScaling(),
    "blockwise": jax_fp8.Float8BlockScaling(),
}
DEFAULT_SIZES = ("1024x1024x1024", "1024x1024x4096", "1024x4096x1024", "4096x2048x2048",
                 "4096x2048x8192", "8192x4096x4096", "8192x4096x16384")


def _step(variant):
    """(x, w, meta) -> (dx, dw, meta): one layer's forward and backward in bf16 compute."""
    def step(carry):
        x, w, meta = carry
        if variant == "bf16":
            dx, dw = jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w.astype(jnp.bfloat16))),
                              argnums=(0, 1))(x, w)
            return x + 1e-6 * dx, w - 1e-6 * dw.astype(w.dtype), meta

        def loss(x, w, meta):
            y, _ = jax_fp8.fp8_dot_general(x, w.astype(jnp.bfloat16), DN, meta)
            return jnp.sum(jnp.tanh(y))

        dx, dw, dm = jax.grad(loss, argnums=(0, 1, 2))(x, w, meta)
        if not meta.stateless:
            meta = jax_fp8.new_fp8_state(meta, dm, RECIPES["delayed"])
        return x + 1e-6 * dx, w - 1e-6 * dw.astype(w.dtype), meta

    return jax.jit(step, donate_argnums=0)


def measure(size, variant, steps):
    t, d_in, d_out = (int(v) for v in size.split("x"))
    key = jax.random.key(0)
    x = jax.random.normal(key, (t, d_in), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (d_in, d_out), jnp.float32) * 0.02
    meta = jax_fp8.Fp8Meta.create(RECIPES["delayed" if variant == "bf16" else variant])
    step = _step(variant)
    carry = step((x, w, meta))
    carry = step(carry)
    jax.block_until_ready(carry)
    carry, events = trace.capture(step, carry, steps=steps)
    kernels = trace.device_events(events)
    return {"size": size, "variant": variant, "flops": 6 * t * d_in * d_out,
            "device_us": trace.total_us(kernels) / steps,
            "gemm_us": trace.by_family(kernels).get("gemm", 0.0) / steps,
            "kernels": len(kernels) / steps}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES))
    parser.add_argument("--variants", default="bf16,delayed,current,blockwise")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--outdir", default=None)
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes.split(","):
        for variant in args.variants.split(","):
            try:
                row = measure(size, variant, args.steps)
            except Exception as err:  # noqa: BLE001  (a recipe a platform cannot run)
                row = {"size": size, "variant": variant, "error": f"{type(err).__name__}: {err}"}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    lines = ["| T x d_in x d_out | GFLOP | " + " | ".join(args.variants.split(",")) +
             " | " + " | ".join(f"bf16/{v}" for v in args.variants.split(",")[1:]) + " |",
             "|" + "---|" * (2 + 2 * len(args.variants.split(",")) - 1)]
    for size in args.sizes.split(","):
        by = {r["variant"]: r for r in rows if r["size"] == size}
        us = [by.get(v, {}).get("device_us") for v in args.variants.split(",")]
        base = by.get("bf16", {}).get("device_us")
        ratio = [f"{base / u:.2f}x" if base and u else "—" for u in us[1:]]
        flops = next((r["flops"] for r in by.values() if "flops" in r), 0)
        lines.append(f"| {size} | {flops / 1e9:.1f} | " +
                     " | ".join(f"{u:.1f} µs" if u else "—" for u in us) + " | " +
                     " | ".join(ratio) + " |")
    table = "\n".join(lines)
    print(table)
    if args.outdir:
        os.makedirs(args.outdir, exist_ok=True)
        with open(os.path.join(args.outdir, "results.json"), "w") as fp:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows},
                      fp, indent=1)
        with open(os.path.join(args.outdir, "results.md"), "w") as fp:
            fp.write(table + "\n")
    return rows


if __name__ == "__main__":
    main()
