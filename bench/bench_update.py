#!/usr/bin/env python3
"""Benchmark: one delayed-scaling update of N FP8 tensors, fused vs the jax.numpy ways.

For every (N tensors, history length L) this measures, in one process, five ways of
running the update (every state donated and threaded through the calls):

  per_tensor_jnp  the update as Flax fp8_ops / TE-JAX run it: one (L,) history and one
                  scalar scale per tensor, jnp.max / jnp.where / 1/x / jnp.roll +
                  .at[0].set(0) per tensor, all in one jax.jit
  stacked_jnp     the same arithmetic on one [N, L] history and one [N] scale
  fused_pytree    jax_fp8.update_states on N separate ScalingState(shape=())
  fused_stacked   jax_fp8.update_states on one ScalingState(shape=(N,))
  floor           a copy of the same bytes: history * one, scale * one (`one` a runtime
                  scalar, so XLA cannot elide it)

and for each: the kernels of the compiled program (jax_fp8.devtools.hlo), the device
time per update (a profiler trace over R calls: on a GPU the sum of the GPU kernel
durations / R; on CPU the median over the calls of the XLA op time), and the wall time
per jitted call (median over many calls, each followed by block_until_ready). A launch
floor is measured too: jax_fp8.amax_and_scale_update on one tensor with L = 1.

Progress goes to stderr, the markdown report to stdout; --outdir DIR writes
DIR/results.json and DIR/results.md (rewritten after every configuration) and
DIR/bench_update.png (needs matplotlib).

Examples:
  python bench/bench_update.py --quick
  python bench/bench_update.py --per-tensor-max-n 1152 --outdir out/bench_update
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import common
import jax_fp8
from jax_fp8.devtools import compilation, hlo, trace

DEFAULT_SIZES = (3, 48, 384, 1152, 4608)
QUICK_SIZES = (3, 48, 384)
DEFAULT_LENGTHS = (16, 1024)
COLUMNS = {
    "per_tensor_jnp": "per-tensor jnp",
    "stacked_jnp": "stacked jnp",
    "fused_pytree": "fused pytree",
    "fused_stacked": "fused stacked",
    "floor": "copy floor",
}
RATIOS = (("per_tensor_jnp", "fused_pytree"), ("stacked_jnp", "fused_pytree"),
          ("stacked_jnp", "fused_stacked"), ("fused_pytree", "floor"), ("fused_stacked", "floor"))
FP8_MAX = 448.0  # float8_e4m3fn
MAX_TRACE_EVENTS = 150_000  # per trace; R is lowered for configurations with many kernels
RECIPE = jax_fp8.DelayedScaling()


def _flax_like_update(history, scale_inv):
    """Flax fp8_ops.update_fp8_meta's arithmetic (margin 0, E4M3), history on the last axis.

    Flax stores the dequantization factor (jax_fp8's scale_inv); the history is rolled
    so that slot 0, the slot the next amax goes to, is cleared.
    """
    amax = jnp.max(history, axis=-1)
    prev = 1.0 / scale_inv
    sf = jnp.where(amax > 0.0, FP8_MAX / amax, prev)
    sf = jnp.where(jnp.isfinite(amax), sf, prev)
    return jnp.roll(history, -1, axis=-1).at[..., 0].set(0.0), 1.0 / sf


def per_tensor_jnp(state):
    outs = [_flax_like_update(h, s) for h, s in zip(*state)]
    return [o[0] for o in outs], [o[1] for o in outs]


def stacked_jnp(state):
    return _flax_like_update(*state)


def fused(state):
    return jax_fp8.update_states(state, recipe=RECIPE)


def copy_floor(state, one):
    history, scale = state
    return history * one, scale * one


FUNCTIONS = {"per_tensor_jnp": per_tensor_jnp, "stacked_jnp": stacked_jnp,
             "fused_pytree": fused, "fused_stacked": fused, "floor": copy_floor}


def initial_history(n, hist_len, seed=0):
    """A deterministic positive [n, L] history (the amaxes of earlier steps)."""
    rng = np.random.default_rng(seed + 7919 * n + hist_len)
    return rng.uniform(0.01, 4.0, size=(n, hist_len)).astype(np.float32)


def make_state(column, base):
    """A fresh device state for ``column`` from the [N, L] NumPy history ``base``."""
    n = base.shape[0]
    e4m3 = jnp.float8_e4m3fn
    if column == "per_tensor_jnp":
        return [jnp.asarray(h) for h in base], [jnp.ones((), jnp.float32) for _ in range(n)]
    if column in ("stacked_jnp", "floor"):
        return jnp.asarray(base), jnp.ones((n,), jnp.float32)
    if column == "fused_pytree":
        return [jax_fp8.ScalingState(jnp.asarray(h), jnp.ones((), jnp.float32),
                                     jnp.ones((), jnp.float32), fp8_dtype=e4m3) for h in base]
    if column == "fused_stacked":
        return jax_fp8.ScalingState(jnp.asarray(base), jnp.ones((n,), jnp.float32),
                                    jnp.ones((n,), jnp.float32), fp8_dtype=e4m3)
    raise ValueError(column)


def tree_bytes(tree):
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def compile_donated(fn, state, extra=()):
    """``jax.jit(fn, donate_argnums=0)`` lowered and compiled; returns (compiled, seconds)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        compiled = jax.jit(fn, donate_argnums=0).lower(state, *extra).compile()
    return compiled, time.perf_counter() - t0


def device_time(call, state, reps, platform):
    """(state, info): ``state = call(state)`` R times under the profiler; info has
    device_us (GPU: the mean over the calls; CPU: the median), events_per_call."""
    try:
        state, events = trace.capture(call, state, steps=reps)
    except Exception as err:  # noqa: BLE001 - a failed trace must not end the run
        return state, {"trace_error": f"{type(err).__name__}: {err}"}
    dev = trace.device_events(events, platform if platform in ("gpu", "cpu") else None)
    if not dev:
        return state, {"trace_error": "no device events in the trace"}
    runs = trace.per_run_us(dev)
    mean = trace.total_us(dev) / reps
    median = float(np.median(runs)) if runs and len(runs) == reps else None
    use_median = platform != "gpu" and median is not None  # one preempted op swings a mean
    return state, {"device_us": median if use_median else mean, "device_us_mean": mean,
                   "device_us_median": median, "kernels_trace": len(dev) / reps,
                   "trace_reps": reps}


def _wall_times(calls, cols, args):
    """Median wall time per call of every column: calls in --wall-blocks blocks that
    alternate between the columns (a drift of the machine hits all alike), each block
    after one untimed call (the first call after another column's measures that
    column's buffer releases), the garbage collector off while timing."""
    budget = {}
    for key, call in calls.items():
        t0 = time.perf_counter()
        cols[key]["state"] = call(cols[key]["state"])
        jax.block_until_ready(cols[key]["state"])
        est = max(time.perf_counter() - t0, 1e-6)
        budget[key] = int(min(args.max_calls,
                              max(args.min_calls, args.wall_seconds / len(calls) / est)))
    samples = {key: [] for key in calls}
    blocks = max(1, args.wall_blocks)
    for b in range(blocks):
        for key, call in calls.items():
            todo = budget[key] * (b + 1) // blocks - budget[key] * b // blocks
            if todo <= 0:
                continue
            c = cols[key]
            c["state"] = call(c["state"])
            jax.block_until_ready(c["state"])
            gc_on = gc.isenabled()
            gc.disable()
            try:
                for _ in range(todo):
                    t0 = time.perf_counter()
                    c["state"] = call(c["state"])
                    jax.block_until_ready(c["state"])
                    samples[key].append(time.perf_counter() - t0)
            finally:
                if gc_on:
                    gc.enable()
    return {k: np.asarray(v) * 1e6 for k, v in samples.items()}


def run_config(n, hist_len, columns, args, platform, progress):
    """Measures ``columns`` at (N, L); returns (rows, failures)."""
    base = initial_history(n, hist_len)
    one = jnp.ones((), jnp.float32)
    cols, failures = {}, []
    for key in columns:
        progress.status(f"N={n} L={hist_len} {key}: compiling")
        try:
            state = make_state(key, base)
            extra = (one,) if key == "floor" else ()
            compiled, compile_s = compile_donated(FUNCTIONS[key], state, extra)
            for _ in range(args.warmup):
                state = compiled(state, *extra)
            jax.block_until_ready(state)
        except Exception as err:  # noqa: BLE001 - the other columns still run
            traceback.print_exc(file=sys.stderr)
            failures.append({"n": n, "l": hist_len, "column": key,
                             "error": f"{type(err).__name__}: {err}"})
            progress.advance(f"N={n} L={hist_len} {key}: FAILED: {type(err).__name__}: {err}")
            continue
        kernels = hlo.count_kernels(compiled)
        cols[key] = {"compiled": compiled, "extra": extra, "state": state, "row": {
            "n": n, "l": hist_len, "column": key, "kernels_hlo": sum(kernels.values()),
            "kernels_hlo_by_opcode": kernels, "compile_s": round(compile_s, 3),
            "state_bytes": tree_bytes(state), "alias_bytes": compilation.alias_bytes(compiled)}}
    calls = {k: (lambda st, c=c: c["compiled"](st, *c["extra"])) for k, c in cols.items()}
    progress.status(f"N={n} L={hist_len}: wall time")
    for key, s in _wall_times(calls, cols, args).items():
        cols[key]["row"].update(wall_us_median=float(np.median(s)), wall_us_min=float(s.min()),
                                wall_calls=int(s.size))
    rows = []
    for key, c in cols.items():
        row = c["row"]
        if not args.no_trace:
            progress.status(f"N={n} L={hist_len} {key}: tracing")
            reps = int(max(2, min(args.trace_reps,
                                  MAX_TRACE_EVENTS // max(row["kernels_hlo"], 1))))
            c["state"], info = device_time(calls[key], c["state"], reps, platform)
            row.update(info)
        rows.append(row)
        dev = row.get("device_us")
        progress.advance(f"N={n} L={hist_len} {key}: {row['kernels_hlo']} kernels, wall "
                         f"{common.fmt_us(row['wall_us_median'])}, device "
                         f"{common.fmt_us(dev) if dev is not None else row.get('trace_error', '-')}"
                         f", compile {row['compile_s']:.2f} s")
    for c in cols.values():  # free the device memory before the next configuration
        for leaf in jax.tree_util.tree_leaves(c["state"]):
            leaf.delete()
    return rows, failures


def launch_floor(args, platform):
    """jax_fp8.amax_and_scale_update on one tensor with L = 1: one tiny custom call."""
    def update(state):
        history, scale, _ = jax_fp8.amax_and_scale_update(*state)
        return history, scale

    state = (jnp.full((1,), 2.0, jnp.float32), jnp.ones((), jnp.float32))
    compiled, _ = compile_donated(update, state)
    for _ in range(3):
        state = compiled(state)
    samples = []
    for _ in range(max(args.min_calls, 50)):
        t0 = time.perf_counter()
        state = compiled(state)
        jax.block_until_ready(state)
        samples.append(time.perf_counter() - t0)
    out = {"what": "jax_fp8.amax_and_scale_update, one tensor, L=1, donated",
           "kernels_hlo": sum(hlo.count_kernels(compiled).values()),
           "wall_us_median": float(np.median(samples) * 1e6)}
    if not args.no_trace:
        _, info = device_time(compiled, state, max(args.trace_reps, 50), platform)
        out.update(info)
    return out


def ratios(results):
    """Per (N, L): numerator / denominator column for RATIOS, on device and wall time."""
    idx = {(r["n"], r["l"], r["column"]): r for r in results}
    out = []
    for n, hist_len in dict.fromkeys((r["n"], r["l"]) for r in results):
        entry = {"n": n, "l": hist_len}
        for metric in ("device_us", "wall_us_median"):
            for num, den in RATIOS:
                a = idx.get((n, hist_len, num), {}).get(metric)
                b = idx.get((n, hist_len, den), {}).get(metric)
                entry[f"{metric}:{num}/{den}"] = a / b if a is not None and b else None
        out.append(entry)
    return out


def markdown(data):
    meta, results = data["meta"], data["results"]
    s = meta["settings"]
    gpu = meta["platform"] == "gpu"
    dev_name = "GPU time" if gpu else "CPU op time"
    idx = {(r["n"], r["l"], r["column"]): r for r in results}
    cols = s["columns"]
    lines = [f"# FP8 scaling update of N tensors — {meta['device']}", "",
             f"jax {meta['jax_version']}, jax_fp8 {meta['jax_fp8_version']} (CPU kernel: "
             f"{meta['has_cpu_kernel']}, CUDA kernel: {meta['has_cuda_kernel']}); "
             f"{meta['machine']}; git {meta['git_commit']}; {meta['date']}.", ""]

    def table(title, cell):
        lines.extend([f"**{title}**", "", "| N | L | " + " | ".join(COLUMNS[c] for c in cols)
                      + " |", "|---:|---:|" + "---:|" * len(cols)])
        for hist_len in s["lengths"]:
            for n in s["sizes"]:
                cells = [cell(idx[(n, hist_len, c)]) if (n, hist_len, c) in idx else "—"
                         for c in cols]
                lines.append(f"| {n} | {hist_len} | " + " | ".join(cells) + " |")
        lines.append("")

    table("Kernels per update (compiled HLO" + (" / trace" if gpu else "") + ")",
          lambda r: f"{r['kernels_hlo']}" + (f" / {r['kernels_trace']:g}"
                                             if gpu and "kernels_trace" in r else ""))
    if any(r.get("device_us") is not None for r in results):
        table(f"{dev_name} per update (profiler trace)",
              lambda r: common.fmt_us(r.get("device_us")))
    table("Wall time per jitted call (median, block_until_ready each)",
          lambda r: common.fmt_us(r.get("wall_us_median")))
    table("Compile time", lambda r: f"{r['compile_s']:.2f} s")
    present = [(a, b) for a, b in RATIOS if a in cols and b in cols]
    for metric, name in (("device_us", dev_name), ("wall_us_median", "wall time")):
        rows = [e for e in data["ratios"] if any(e.get(f"{metric}:{a}/{b}") for a, b in present)]
        if not present or not rows:
            continue
        lines.extend([f"**Ratios ({name})**", "", "| N | L | " + " | ".join(
            f"{COLUMNS[a]} / {COLUMNS[b]}" for a, b in present) + " |",
            "|---:|---:|" + "---:|" * len(present)])
        for e in rows:
            lines.append(f"| {e['n']} | {e['l']} | " + " | ".join(
                common.fmt_ratio(e.get(f"{metric}:{a}/{b}")) for a, b in present) + " |")
        lines.append("")
    lf = data.get("launch_floor")
    if lf:
        lines.extend([f"**Launch floor** ({lf['what']}): {lf['kernels_hlo']} kernel(s), "
                      f"{dev_name} {common.fmt_us(lf.get('device_us'))}, wall "
                      f"{common.fmt_us(lf['wall_us_median'])}", ""])
    if data["skipped"]:
        lines.append("Skipped (— above): " + "; ".join(
            f"{x['column']} at N={x['n']} L={x['l']} ({x['reason']})" for x in data["skipped"]))
    for f in data["failures"]:
        lines.append(f"FAILED N={f.get('n')} L={f.get('l')} {f.get('column', '')}: {f['error']}")
    lines.extend(["", common.command_line(meta)])
    return "\n".join(lines)


def _ints(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _columns(text):
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in COLUMNS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"columns are a subset of {','.join(COLUMNS)}")
    return [k for k in COLUMNS if k in values]


def build_parser():
    p = common.arg_parser("One FP8 scaling update of N tensors: jax_fp8's fused update vs the "
                          "per-tensor and stacked jax.numpy updates and a copy "
                          "(bench/README.md).", __doc__)
    p.add_argument("--sizes", type=_ints, default=None,
                   help=f"numbers of tensors N (default {','.join(map(str, DEFAULT_SIZES))}; "
                        f"--quick {','.join(map(str, QUICK_SIZES))})")
    p.add_argument("--lengths", type=_ints, default=list(DEFAULT_LENGTHS),
                   help="history lengths L (default 16,1024)")
    p.add_argument("--columns", type=_columns, default=list(COLUMNS),
                   help="a subset of " + ",".join(COLUMNS) + " (default all)")
    p.add_argument("--quick", action="store_true", help="small N, fewer calls (about a minute)")
    p.add_argument("--per-tensor-max-n", type=int, default=None, metavar="N",
                   help="skip per_tensor_jnp and fused_pytree above N (their compile time "
                        "grows faster than linearly with the number of separate arrays)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per column (3)")
    p.add_argument("--min-calls", type=int, default=None,
                   help="timed calls at least (10; --quick 3)")
    p.add_argument("--max-calls", type=int, default=None,
                   help="timed calls at most (2000; --quick 100)")
    p.add_argument("--wall-seconds", type=float, default=None,
                   help="wall-time budget per configuration, shared by the columns "
                        "(1.5; --quick 0.3)")
    p.add_argument("--wall-blocks", type=int, default=None,
                   help="timed blocks per column, alternating between columns (4; --quick 2)")
    p.add_argument("--trace-reps", type=int, default=None, help="calls per trace (20; --quick 5)")
    p.add_argument("--no-trace", action="store_true", help="no profiler traces (wall time only)")
    p.add_argument("--no-launch-floor", action="store_true", help="skip the launch floor")
    p.add_argument("--outdir", metavar="DIR", default=None,
                   help="write DIR/results.json, DIR/results.md and DIR/bench_update.png")
    return p


def _finalize(args):
    q = args.quick
    args.sizes = args.sizes or list(QUICK_SIZES if q else DEFAULT_SIZES)
    for name, quick, full in (("min_calls", 3, 10), ("max_calls", 100, 2000),
                              ("wall_seconds", 0.3, 1.5), ("wall_blocks", 2, 4),
                              ("trace_reps", 5, 20)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    args.min_calls = max(1, args.min_calls)
    args.max_calls = max(args.min_calls, args.max_calls)
    args.trace_reps = max(1, args.trace_reps)
    return args


def assemble(meta, results, floor, failures, skipped):
    data = {"meta": meta, "results": results, "launch_floor": floor, "ratios": ratios(results),
            "failures": failures, "skipped": skipped}
    data["report_markdown"] = markdown(data)
    return data


def run(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _finalize(build_parser().parse_args(argv))
    platform = common.platform_name()
    meta = common.environment(__file__, argv)
    meta["settings"] = {k: getattr(args, k) for k in (
        "sizes", "lengths", "columns", "warmup", "min_calls", "max_calls", "wall_seconds",
        "wall_blocks", "trace_reps", "no_trace", "per_tensor_max_n")}
    kernel = meta["has_cuda_kernel"] if platform == "gpu" else meta["has_cpu_kernel"]
    plan, skipped = [], []
    for hist_len in args.lengths:
        for n in args.sizes:
            cols = []
            for c in args.columns:
                if (args.per_tensor_max_n is not None and n > args.per_tensor_max_n
                        and c in ("per_tensor_jnp", "fused_pytree")):
                    skipped.append({"n": n, "l": hist_len, "column": c,
                                    "reason": f"--per-tensor-max-n {args.per_tensor_max_n}"})
                else:
                    cols.append(c)
            plan.append((n, hist_len, cols))
    results, failures, floor = [], [], None
    t_all = time.perf_counter()
    with common.Progress(sum(len(c) for *_, c in plan), "bench_update") as progress:
        progress.log(f"bench_update: {meta['device']} ({platform}), jax {meta['jax_version']}, "
                     f"N {args.sizes}, L {args.lengths}")
        if not kernel:
            progress.log(f"WARNING: jax_fp8's {platform} kernel is not loaded; the fused "
                         "columns run the jax.numpy fallback")
        for n, hist_len, cols in plan:
            rows, fails = run_config(n, hist_len, cols, args, platform, progress)
            results += rows
            failures += fails
            if args.outdir:  # an interrupted run keeps what it measured
                meta["total_s"] = round(time.perf_counter() - t_all, 1)
                _write(args.outdir, assemble(meta, results, floor, failures, skipped), plot=False)
        if not args.no_launch_floor:
            progress.status("launch floor")
            try:
                floor = launch_floor(args, platform)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                failures.append({"column": "launch floor", "error": f"{type(err).__name__}: {err}"})
    meta["total_s"] = round(time.perf_counter() - t_all, 1)
    data = assemble(meta, results, floor, failures, skipped)
    if args.outdir:
        _write(args.outdir, data, plot=True)
    print(data["report_markdown"])
    return data


def _write(outdir, data, plot):
    common.write_outputs(outdir, data)
    if plot:
        common.save_plot("plot_update", data, os.path.join(outdir, "bench_update.png"),
                         lambda m: print(m, file=sys.stderr))


def main(argv=None):
    return 1 if run(argv)["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
