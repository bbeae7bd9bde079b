#!/usr/bin/env python3
"""Draws a benchmark's results.json: bench_update.py's or bench_train_step.py's (needs matplotlib).

  python bench/plot.py out/bench_update/results.json --png bench_update.png
  python bench/plot.py out/bench_train_step/results.json --png train_step.png

bench_update: time per update vs N, log-log, one panel per history length (the
profiler's device time where measured, else the wall time per call). bench_train_step:
one panel per model size, a bar per variant: device time per step split into the GEMM
kernels and the rest (the pipelined wall time where no trace was taken), the speed-up
vs bf16 above each bar.
"""

from __future__ import annotations

import argparse
import json
import sys

UPDATE_STYLE = {  # column: (color, line style, label)
    "per_tensor_jnp": ("#d62728", "o-", "per-tensor jnp"),
    "stacked_jnp": ("#ff7f0e", "s-", "stacked jnp"),
    "fused_pytree": ("#1f77b4", "^-", "jax_fp8, per-tensor pytree"),
    "fused_stacked": ("#2ca02c", "v--", "jax_fp8, stacked"),
    "floor": ("#7f7f7f", "x:", "copy floor"),
}
VARIANT_COLORS = ["#7f7f7f", "#ff7f0e", "#1f77b4", "#9ecae1", "#2ca02c", "#98df8a", "#9467bd"]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_update(data, png, dpi=80):
    """bench_update.py's results: time per update vs N."""
    plt = _pyplot()
    results = data.get("results", [])
    key = "device_us" if results and all(r.get("device_us") for r in results) else "wall_us_median"
    meta = data.get("meta", {})
    where = "GPU" if meta.get("platform") == "gpu" else "CPU op"
    ylabel = f"{where} time per update (µs)" if key == "device_us" else "wall time per call (µs)"
    lengths = sorted({r["l"] for r in results}) or [0]
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), squeeze=False,
                             sharey=True)
    for ax, hist_len in zip(axes[0], lengths):
        for col, (color, style, label) in UPDATE_STYLE.items():
            pts = sorted((r["n"], r[key]) for r in results
                         if r["l"] == hist_len and r["column"] == col and r.get(key))
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=label, markersize=4, linewidth=1.2)
        floor = (data.get("launch_floor") or {}).get(key)
        if floor:
            ax.axhline(floor, color="black", linewidth=0.7, linestyle="-.", alpha=0.6,
                       label="launch floor (1 tiny kernel)")
        ax.set(xscale="log", yscale="log", title=f"L = {hist_len}", xlabel="N tensors")
        ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7, loc="upper left", framealpha=0.8)
    fig.suptitle(f"One FP8 scaling update of N tensors — {meta.get('device', '?')}, "
                 f"jax {meta.get('jax_version', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    plt.close(fig)
    return png


def plot_train_step(data, png, dpi=90):
    """bench_train_step.py's results: time per step by variant, one panel per size."""
    plt = _pyplot()
    results = data.get("results", [])
    sizes = list(dict.fromkeys(r["size"] for r in results))
    variants = list(dict.fromkeys(r["variant"] for r in results))
    colors = {v: VARIANT_COLORS[i % len(VARIANT_COLORS)] for i, v in enumerate(variants)}
    fig, axes = plt.subplots(1, max(1, len(sizes)), figsize=(3.6 * max(1, len(sizes)) + 1, 3.8),
                             squeeze=False)
    for ax, size in zip(axes[0], sizes):
        rows = [r for r in results if r["size"] == size]
        device = all(r.get("device_ms") for r in rows)
        metric = "device_ms" if device else "pipelined_ms"
        base = next((r.get(metric) for r in rows if r["variant"] == "bf16"), None)
        for i, r in enumerate(rows):
            total = r.get(metric) or 0.0
            gemm = r.get("gemm_ms") if device else None
            label = r["variant"]
            if gemm is not None:
                ax.bar(i, gemm, color=colors[label], edgecolor="black", linewidth=0.5)
                ax.bar(i, total - gemm, bottom=gemm, color=colors[label], alpha=0.45,
                       edgecolor="black", linewidth=0.5, hatch="//")
            else:
                ax.bar(i, total, color=colors[label], edgecolor="black", linewidth=0.5)
            if base and total:
                ax.text(i, total, f"{base / total:.2f}×", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [r["variant"] for r in rows], rotation=30, ha="right",
                      fontsize=7)
        d, blocks, tokens = size.split("x")
        ax.set_title(f"d={d}, {blocks} blocks, {tokens} tokens", fontsize=9)
        ax.set_ylabel(("device" if device else "pipelined wall") + " time per step (ms)",
                      fontsize=8)
        ax.grid(True, axis="y", linewidth=0.3, alpha=0.5)
        ax.margins(y=0.12)
    meta = data.get("meta", {})
    # Two lines: one panel (a single size) is too narrow for the whole title on one.
    fig.suptitle(f"Train step — {meta.get('device', '?')}, jax {meta.get('jax_version', '?')}\n"
                 "solid: GEMM kernels, hatched: the rest; × vs bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    plt.close(fig)
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="a results.json of bench_update.py or bench_train_step.py")
    p.add_argument("--png", default=None, help="output PNG (default: next to the JSON)")
    args = p.parse_args(argv)
    with open(args.json) as fp:
        data = json.load(fp)
    train = any("variant" in r for r in data.get("results", []))
    png = args.png or args.json.rsplit(".", 1)[0] + ".png"
    (plot_train_step if train else plot_update)(data, png)
    print(f"wrote {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
