#!/usr/bin/env python3
"""Flax's own Gemma example (google/flax ``examples/gemma``, its code unmodified), trained a step
at a time: bf16 against the same model converted by `jax_fp8.flax.fp8_model` with the default
rules, per recipe.

The model is the example's ``Transformer`` built from ``TransformerConfig.from_version_name``
(``--model``, default its ``gemma3_1b``) with bfloat16 activations and float32 parameters, as
the example's ``train.py`` builds it, trained with the example's optimizer (``optax.adamw``,
b1 0.9, b2 0.98, eps 1e-9, weight decay 0.1) on random tokens of its lm1b vocabulary size
(35,008) with a causal mask, ``--batch`` x ``--seq`` tokens a step. The bf16 step is the
example's (``nnx.value_and_grad`` over the parameters, ``nnx.Optimizer``); the FP8 step is the
one jax_fp8's NNX pages write (``fp8_value_and_grad``, ``Fp8Optimizer``) after one call,
``fp8_model(model, Fp8Rule(recipe=...))``: the default rules, ``min_fp8_flops="measured"``.

Each variant runs in a process of its own (``--variant`` picks one; without it every
variant in turn, each in a fresh subprocess, so compile times are cold). Reported: compile
time, device time per step from a profiler trace (by kernel family: bench/llm_kernels.py),
the GEMM floor, the FP8 GEMMs in the compiled program, and the loss of the first step,
checked against the bf16 step's before anything is timed.

    git clone https://github.com/google/flax && \\
    python bench/bench_flax_gemma.py --example-dir flax/examples/gemma --outdir out/gemma
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

RECIPES = ("delayed", "current", "block")
VOCAB = 35_008   # the example's lm1b vocabulary size (its benchmark configs' vocab_size)


def run_variant(args) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_fp8
    from jax_fp8.devtools import trace
    from jax_fp8.flax import Fp8Rule, fp8_model
    from jax_fp8.flax.nnx import Fp8Optimizer, fp8_value_and_grad

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llm_kernels

    sys.path.insert(0, os.path.abspath(args.example_dir))
    import transformer as transformer_lib  # the example's own module

    cfg = transformer_lib.TransformerConfig.from_version_name(args.model, num_embed=VOCAB,
                                                              dtype=jnp.bfloat16)
    model = transformer_lib.Transformer(cfg, rngs=nnx.Rngs(params=0, dropout=0))
    tx = optax.adamw(1e-4, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    rng = jax.random.key(1)
    tokens = jax.random.randint(rng, (args.batch, args.seq + 1), 1, VOCAB)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = transformer_lib.make_causal_attn_mask(inputs > 0)
    positions = transformer_lib.build_positions_from_mask(inputs > 0)

    def loss_fn(model, inputs, targets, mask):
        logits, _ = model(inputs, positions=positions, attention_mask=mask, cache=None)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), targets).mean()

    row = {"variant": args.variant, "model": args.model, "tokens": args.batch * args.seq}
    if args.variant == "bf16":
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        value_and_grad = nnx.value_and_grad
    else:
        recipe = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.Float8CurrentScaling(),
                  "block": jax_fp8.Float8BlockScaling()}[args.variant]
        rule = Fp8Rule(recipe=recipe) if args.rule == "default" else Fp8Rule(
            recipe=recipe, min_fp8_flops=0)
        row["rule"] = repr(rule)
        fp8_model(model, rule)
        optimizer = Fp8Optimizer(model, tx, wrt=nnx.Param, recipe=recipe)
        value_and_grad = fp8_value_and_grad

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, inputs, targets, mask):
        loss, grads = value_and_grad(loss_fn)(model, inputs, targets, mask)
        optimizer.update(model, grads)
        return loss

    t0 = time.perf_counter()
    compiled = train_step.lower(model, optimizer, inputs, targets, mask).compile()
    row["compile_s"] = time.perf_counter() - t0
    text = compiled.as_text()
    gemms = llm_kernels.hlo.gemms(llm_kernels.hlo.parse(text))
    row["fp8_gemms"] = sum(1 for g in gemms if g.fp8)
    row["gemms"] = len(gemms)
    first = float(train_step(model, optimizer, inputs, targets, mask))
    row["first_loss"] = first
    train_step(model, optimizer, inputs, targets, mask)
    if args.device_time:
        families = llm_kernels.hlo_families(text, gemms)

        def step(carry):
            return train_step(model, optimizer, inputs, targets, mask)

        _, events = trace.capture(step, jnp.zeros(()), steps=args.steps)
        events = trace.device_events(events, platform="gpu")
        ms, _, top, _ = llm_kernels.split_by_family(events, families, args.steps, top=6)
        row["device_ms"] = trace.total_us(events) / args.steps / 1e3
        row["families_ms"] = ms
        row["floor_ms"] = sum(ms.get(f, 0.0) for f in llm_kernels.GEMM_FAMILIES)
        row["top_kernels"] = top
    else:
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(train_step(model, optimizer, inputs, targets, mask))
            times.append((time.perf_counter() - t0) * 1e3)
        row["wall_ms"] = sorted(times)[len(times) // 2]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--example-dir", required=True,
                        help="google/flax's examples/gemma directory, unmodified")
    parser.add_argument("--model", default="gemma3_1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", nargs="+", default=["bf16", *RECIPES],
                        choices=["bf16", *RECIPES])
    parser.add_argument("--rule", choices=("default", "all"), default="default",
                        help="FP8 variants: fp8_model's default rules, or every GEMM "
                             "(min_fp8_flops=0)")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--outdir", default=None)
    args = parser.parse_args(argv)
    args.device_time = None
    if args.variant is not None:   # one variant, in this process
        import jax
        args.device_time = jax.devices()[0].platform == "gpu"
        print("ROW " + json.dumps(run_variant(args)), flush=True)
        return None
    rows = []
    for variant in args.variants:
        cmd = [sys.executable, os.path.abspath(__file__), "--example-dir", args.example_dir,
               "--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq),
               "--steps", str(args.steps), "--rule", args.rule, "--variant", variant]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(found[-1]) if found else {
            "variant": variant, "error": (proc.stderr or proc.stdout)[-600:]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}),
              file=sys.stderr, flush=True)
    base = next((r for r in rows if r["variant"] == "bf16" and "error" not in r), None)
    for r in rows:
        t = r.get("device_ms") or r.get("wall_ms")
        if base and "error" not in r and r is not base:
            if abs(r["first_loss"] - base["first_loss"]) > 0.05 * abs(base["first_loss"]):
                r["error"] = (f"first loss {r['first_loss']} not within 5% of bf16's "
                              f"{base['first_loss']}: no time reported")
                continue
            b = base.get("device_ms") or base.get("wall_ms")
            r["speedup"] = b / t if t else None
    lines = ["| variant | compile s | device ms | floor ms | vs bf16 | FP8 GEMMs / GEMMs |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][:200]} | | | | |")
            continue
        t = r.get("device_ms") or r.get("wall_ms")
        lines.append(f"| {r['variant']} | {r['compile_s']:.1f} | {t:.2f} | "
                     f"{r.get('floor_ms', float('nan')):.2f} | "
                     f"{r.get('speedup') or 1.0:.3f}x | {r['fp8_gemms']} / {r['gemms']} |")
    print("\n".join(lines))
    if args.outdir:
        os.makedirs(args.outdir, exist_ok=True)
        with open(os.path.join(args.outdir, "gemma.json"), "w") as fp:
            json.dump({"argv": sys.argv, "rows": rows}, fp, indent=1)
        with open(os.path.join(args.outdir, "gemma.md"), "w") as fp:
            fp.write("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
