#!/usr/bin/env python3
"""Plots bench_update.py's JSON: time per update vs N, log-log, one panel per L.

Usage:
  python bench/plot.py results.json --png docs/bench_cpu.png [--metric auto|device|wall]

`auto` plots the profiler's device time (GPU time on a GPU, XLA CPU op time on
CPU) where it was measured, else the wall time per jitted call.
"""

from __future__ import annotations

import argparse
import json
import sys

COLORS = {
    "per_tensor_jnp": "#d62728",
    "stacked_jnp": "#ff7f0e",
    "fused_pytree": "#1f77b4",
    "fused_stacked": "#2ca02c",
    "floor": "#7f7f7f",
}
STYLES = {"per_tensor_jnp": "o-", "stacked_jnp": "s-", "fused_pytree": "^-",
          "fused_stacked": "v--", "floor": "x:"}
LABELS = {
    "per_tensor_jnp": "per-tensor jnp",
    "stacked_jnp": "stacked jnp",
    "fused_pytree": "jax_fp8, per-tensor pytree",
    "fused_stacked": "jax_fp8, stacked",
    "floor": "copy floor",
}


def _metric(data, metric):
    if metric == "wall":
        return "wall_us_median"
    if metric == "device":
        return "device_us"
    results = data.get("results", [])
    if results and all(r.get("device_us") is not None for r in results):
        return "device_us"
    return "wall_us_median"


def plot(data, png, metric="auto", dpi=80):
    """Writes the figure for `data` (bench_update.py's result dict) to `png`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = _metric(data, metric)
    meta = data.get("meta", {})
    gpu = meta.get("platform") == "gpu"
    if key == "device_us":
        ylabel = "GPU time per update (µs)" if gpu else "CPU op time per update (µs)"
    else:
        ylabel = "wall time per call (µs)"
    results = data.get("results", [])
    lengths = sorted({r["l"] for r in results}) or [0]
    columns = [c["key"] for c in data.get("columns", [])] or list(COLORS)
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4),
                             squeeze=False, sharey=True)
    for ax, hist_len in zip(axes[0], lengths):
        for col in columns:
            pts = sorted((r["n"], r[key]) for r in results
                         if r["l"] == hist_len and r["column"] == col and r.get(key))
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, STYLES.get(col, "o-"), color=COLORS.get(col),
                    label=LABELS.get(col, col), markersize=4, linewidth=1.2)
        lf = (data.get("launch_floor") or {}).get(key)
        if lf:
            ax.axhline(lf, color="black", linewidth=0.7, linestyle="-.", alpha=0.6,
                       label="launch floor (1 tiny kernel)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"L = {hist_len}", fontsize=10)
        ax.set_xlabel("N tensors", fontsize=9)
        ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
        ax.tick_params(labelsize=8)
    axes[0][0].set_ylabel(ylabel, fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", framealpha=0.8)
    title = f"{meta.get('device', '?')}, jax {meta.get('jax_version', '?')}"
    fig.suptitle(f"One FP8 scaling update of N tensors — {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    plt.close(fig)
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="bench_update.py --out / --outdir results.json")
    p.add_argument("--png", default="bench_update.png", help="output PNG")
    p.add_argument("--metric", choices=("auto", "device", "wall"), default="auto")
    p.add_argument("--dpi", type=int, default=80)
    args = p.parse_args(argv)
    with open(args.json) as fp:
        data = json.load(fp)
    plot(data, args.png, args.metric, args.dpi)
    print(f"wrote {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
