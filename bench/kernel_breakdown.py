"""Where a train step's GPU time goes, by source op: a trace's kernels joined to the HLO.

Reads a `bench_train_step.py --save-hlo --top-kernels N` output directory: each variant's
kernels (name, count and µs per step, from results.json) are matched to the fusions and
custom calls of its compiled HLO (a kernel is named after its fusion, or after the
fusion whose code it reuses: ``deduplicated_name``), and their time is summed by the
JAX source op in the HLO metadata, with layer numbers removed (``blockN/`` -> ``block*/``)
so that every layer's copy of an op adds up in one row.

    python bench/kernel_breakdown.py DIR [--variants jax_fp8,flax_fp8] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re

import bench_update  # HLO computations parser

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?(?:fusion|custom-call)\(")
_ATTR = {k: re.compile(k + r'="([^"]*)"') for k in
         ("op_name", "scheduling_name", "deduplicated_name", "custom_call_target")}
_CALLS = re.compile(r"calls=%([\w.\-]+)")


def _kernel_key(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def _normalise(op_name: str) -> str:
    op = re.sub(r"^jit\([^)]*\)/", "", op_name)
    op = re.sub(r"block\d+", "block*", op)
    op = re.sub(r"_\d+(?=/|$)", "", op)  # Fp8DotGeneral_0 -> Fp8DotGeneral
    return op


def hlo_sources(text: str) -> dict[str, list[str]]:
    """kernel key -> source ops of the instructions that launch it."""
    comps, _ = bench_update.parse_hlo_computations(text)
    comp_ops: dict[str, str] = {}  # computation -> the op_name of its first instruction
    for name, lines in comps.items():
        for _, line in lines:
            m = _ATTR["op_name"].search(line)
            if m:
                comp_ops[name] = m.group(1)
                break
    groups: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        attrs = {k: (r.search(line).group(1) if r.search(line) else None)
                 for k, r in _ATTR.items()}
        sched = attrs["scheduling_name"] or m.group(1)
        op = attrs["op_name"]
        if not op:
            c = _CALLS.search(line)
            op = comp_ops.get(c.group(1)) if c else None
        if not op and attrs["custom_call_target"]:
            op = attrs["custom_call_target"]
        # Fusions that share one kernel share a deduplicated_name; the trace names the
        # kernel after one of them, so every member's name leads to the whole group.
        groups[attrs["deduplicated_name"] or sched].append((sched, _normalise(op or "?" + sched)))
    out: dict[str, list[str]] = {}
    for members in groups.values():
        ops = [op for _, op in members]
        for sched, _ in members:
            out[_kernel_key(sched)] = ops
    return out


def breakdown(kernels, sources):
    """(source op -> [µs, kernels]) with each kernel's time split over its instructions."""
    rows = collections.defaultdict(lambda: [0.0, 0.0])
    for k in kernels:
        key = _kernel_key(k["name"])
        if key.startswith("nvjet") or "gemm" in key or "cutlass" in key:
            srcs = ["GEMM (cuBLAS / nvjet)"]
        else:
            srcs = sources.get(key) or [f"[unmatched] {k['name'][:60]}"]
        for s in srcs:
            rows[s][0] += k["us_per_call"] / len(srcs)
            rows[s][1] += k["per_call"] / len(srcs)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--variants", default=None, help="comma-separated (default: all with HLO)")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    data = json.load(open(os.path.join(args.outdir, "results.json")))
    want = args.variants.split(",") if args.variants else None
    for r in data["results"]:
        v = r["variant"]
        path = os.path.join(args.outdir, f"hlo_{r['d']}x{r['tokens']}_{v}.txt.gz")
        if (want and v not in want) or not os.path.exists(path) or not r.get("top_kernels"):
            continue
        with gzip.open(path, "rt") as fp:
            sources = hlo_sources(fp.read())
        rows = breakdown(r["top_kernels"], sources)
        total = sum(u for u, _ in rows.values())
        print(f"\n## {v}: {total / 1e3:.3f} ms of kernels per step "
              f"(device time {r.get('device_ms', float('nan')):.3f} ms)")
        print(f"{'µs/step':>10} {'kernels':>8}  source op")
        for src, (us, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"{us:10.1f} {n:8.1f}  {src[:120]}")


if __name__ == "__main__":
    main()
