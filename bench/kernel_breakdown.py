"""Where a train step's GPU time goes, by source op: a trace's kernels joined to the HLO.

Reads a `bench_train_step.py --save-hlo --top-kernels N` output directory: each variant's
kernels (name, count and µs per step, from results.json) are matched to the fusions and
custom calls of its compiled HLO (a kernel is named after its fusion, or after the
fusion whose code it reuses: ``deduplicated_name``), and their time is summed by the
JAX source op in the HLO metadata, with layer numbers removed (``blockN/`` -> ``block*/``)
so that every layer's copy of an op adds up in one row.

    python bench/kernel_breakdown.py DIR [--variants jax_fp8,flax_fp8] [--top 40]

`--diff A,B DIR` (results.json only, no HLO): variant A minus variant B by kernel family
(the fusion kind with its number dropped: `input_add_reduce_fusion.12` ->
`input_add_reduce_fusion`), e.g. `--diff jax_fp8,jax_fp8_noupdate` for what the
bookkeeping is made of. A DIR/B form takes B from another run's results.json.

`--amax HLO_FILE` (text or .gz; no trace needed) says instead where each FP8 amax
reduction of `fp8_dot_general` landed in the compiled step: in the same fusion as its
FP8 cast or not, and which other source ops XLA fused with it (LayerNorm, adam, ...).
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


def amax_fusions(text: str) -> list[tuple[int, str, bool, str]]:
    """(fusions, amax source op, FP8 cast in the same fusion, other source ops fused with
    it) for every fused computation holding an `Fp8DotGeneral` reduce_max, grouped over
    layers. (A two-stage reduction's second stage shows as an amax with nothing else.)"""
    comps, _ = bench_update.parse_hlo_computations(text)
    groups: collections.Counter = collections.Counter()
    for lines in comps.values():
        ops = [(op, line, _ATTR["op_name"].search(line)) for op, line in lines]
        amax = sorted({_normalise(m.group(1)) for op, _, m in ops
                       if op == "reduce" and m and "Fp8DotGeneral" in m.group(1)
                       and m.group(1).endswith("reduce_max")})
        if not amax:
            continue
        fp8_cast = any(op == "convert" and re.search(r"= f8e\w*\[", line) for op, line, _ in ops)
        others = sorted({"/".join(_normalise(m.group(1)).split("/")[-2:]) for _, _, m in ops
                         if m and "Fp8DotGeneral" not in m.group(1)})
        groups[(" + ".join(amax), fp8_cast, ", ".join(others))] += 1
    return [(n, a, c, o) for (a, c, o), n in sorted(groups.items(), key=lambda kv: -kv[1])]


def kernel_family(name: str) -> str:
    """`input_add_reduce_fusion.12` / `loop_add_fusion_3` -> the fusion kind."""
    return re.sub(r"(?:[._]\d+)+$", "", name)


def family_diff(kernels_a, kernels_b) -> list[tuple[float, str, float, float]]:
    """(µs per step A − B, family, kernels per step in A, in B), largest |difference|
    first, from two `top_kernels` lists."""
    fam: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for i, kernels in enumerate((kernels_a, kernels_b)):
        for k in kernels:
            f = fam[kernel_family(k["name"])]
            f[i] += k["us_per_call"]
            f[2 + i] += k["per_call"]
    rows = [(a - b, name, na, nb) for name, (a, b, na, nb) in fam.items()]
    return sorted(rows, key=lambda r: -abs(r[0]))


def _load_variant(outdir: str, spec: str):
    path, _, variant = spec.rpartition("/")
    data = json.load(open(os.path.join(path or outdir, "results.json")))
    for r in data["results"]:
        if r["variant"] == variant and r.get("top_kernels"):
            return r
    raise SystemExit(f"no variant {variant!r} with top_kernels in {path or outdir}")


def print_family_diff(outdir: str, spec: str, top: int) -> None:
    a_spec, b_spec = spec.split(",")
    a, b = _load_variant(outdir, a_spec), _load_variant(outdir, b_spec)
    rows = family_diff(a["top_kernels"], b["top_kernels"])
    print(f"## {a_spec} − {b_spec}: device {a.get('device_ms', float('nan')):.3f} − "
          f"{b.get('device_ms', float('nan')):.3f} ms")
    print(f"{'µs/step':>10} {'kernels A':>9} {'kernels B':>9}  family")
    for d, name, na, nb in rows[:top]:
        print(f"{d:10.1f} {na:9.0f} {nb:9.0f}  {name[:100]}")


def print_amax_fusions(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fp:
        rows = amax_fusions(fp.read())
    print("| fusions | amax of | FP8 cast in the same fusion | fused with |")
    print("|---|---|---|---|")
    for n, amax, cast, others in rows:
        print(f"| {n} | `{amax}` | {'yes' if cast else 'no'} | {others or '(nothing else)'} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", nargs="?")
    p.add_argument("--diff", metavar="A,B", help="variant A minus B by kernel family")
    p.add_argument("--amax", metavar="HLO_FILE",
                   help="where the amax reductions landed in this compiled HLO (no trace)")
    p.add_argument("--variants", default=None, help="comma-separated (default: all with HLO)")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    if args.amax:
        return print_amax_fusions(args.amax)
    if args.diff:
        return print_family_diff(args.outdir or ".", args.diff, args.top)
    if not args.outdir:
        p.error("give DIR (a bench_train_step.py --save-hlo output) or --amax HLO_FILE")
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
