#!/usr/bin/env python3
"""Benchmark: the fused FP8 scaling update against what JAX users run today.

For every (N tensors, history length L) configuration this measures, in one
process, five ways of running one delayed-scaling update of N FP8 tensors:

  per_tensor_jnp  the update as Flax fp8_ops / TE-JAX run it: one (L,) history and
                  one scalar scale per tensor, jnp.max / jnp.where / jnp.roll +
                  .at[0].set(0) per tensor, all in one jax.jit, state donated
  stacked_jnp     the same math on one [N, L] history and one [N] scale (donated)
  fused_pytree    jax_fp8.update_states on N separate ScalingState(shape=()) (donated)
  fused_stacked   jax_fp8.update_states on one ScalingState(shape=(N,)) (donated)
  floor           a copy of the same bytes: one elementwise read+write pass over
                  the [N, L] history and the [N] scale (x * one, `one` a runtime
                  argument so XLA cannot elide it; donated)

and for each: kernels launched (from the compiled HLO's entry computation, and on
GPU from the profiler trace too), device time per update (GPU: the sum of kernel
`dur` on the GPU stream processes of a jax.profiler perfetto trace over R calls,
divided by R, as MEASURING.md describes; CPU: the same sum over the XLA CPU
runtime's op events, i.e. the time spent in XLA ops), and wall time per jitted
call (median over many calls, each followed by block_until_ready). The state is
threaded through the calls (call i's output is call i+1's input) so donation
holds. A "launch floor" is measured too: jax_fp8.amax_and_scale_update on one
tensor with L = 1 (one tiny custom call).

Progress goes to stderr; a markdown report (tables, ratios, targets) to stdout;
--out writes the JSON, --outdir DIR writes DIR/results.json, DIR/results.md and
DIR/bench_update.png (the PNG needs matplotlib; without it a note is printed and
bench/plot.py can draw it later from the JSON).

Examples:
  python bench/bench_update.py --quick
  python bench/bench_update.py --sizes 3,48,384,1152 --lengths 16,1024 --out results.json
  python bench/bench_update.py --outdir bench_out_h200
"""

from __future__ import annotations

import argparse
import datetime
import gc
import glob
import gzip
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

import jax
import jax.numpy as jnp

import jax_fp8

DEFAULT_SIZES = (3, 48, 384, 1152, 4608)
DEFAULT_LENGTHS = (16, 1024)
QUICK_SIZES = (3, 48, 384)

COLUMNS = (
    ("per_tensor_jnp", "per-tensor jnp"),
    ("stacked_jnp", "stacked jnp"),
    ("fused_pytree", "jax_fp8 fused, per-tensor pytree"),
    ("fused_stacked", "jax_fp8 fused, stacked"),
    ("floor", "copy floor"),
)
COLUMN_KEYS = tuple(k for k, _ in COLUMNS)
SHORT_LABELS = {
    "per_tensor_jnp": "per-tensor jnp",
    "stacked_jnp": "stacked jnp",
    "fused_pytree": "fused pytree",
    "fused_stacked": "fused stacked",
    "floor": "copy floor",
}

FP8_MAX = 448.0  # float8_e4m3fn
MARGIN = 0.0

# The targets of the issue are stated at this configuration.
TARGET_N, TARGET_L = 1152, 1024

# Keep each parsed trace to roughly this many device events (the per-tensor jnp
# baseline launches 5 kernels per tensor, so R is lowered for large N).
MAX_TRACE_EVENTS = 150_000


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# The five update functions. Each maps (state, *extra) -> new state of the same structure.
# --------------------------------------------------------------------------------------

def _flax_like_update(history, scale_inv):
    """Flax fp8_ops.update_fp8_meta's arithmetic (margin 0, E4M3), history on the last axis.

    Flax (and TE-JAX) store the dequantization factor, which Flax calls `scale`
    (SPEC.md's scale_inv). The history is rolled so that slot 0 (the staging slot)
    is cleared, as in SPEC.md and MEASURING.md's baseline.
    """
    amax = jnp.max(history, axis=-1)
    prev = 1.0 / scale_inv
    sf = (FP8_MAX / amax) / (2.0 ** MARGIN)
    sf = jnp.where(amax > 0.0, sf, prev)
    sf = jnp.where(jnp.isfinite(amax), sf, prev)
    new_history = jnp.roll(history, -1, axis=-1).at[..., 0].set(0.0)
    return new_history, 1.0 / sf


def per_tensor_jnp(state):
    histories, scales = state
    outs = [_flax_like_update(h, s) for h, s in zip(histories, scales)]
    return [o[0] for o in outs], [o[1] for o in outs]


def stacked_jnp(state):
    history, scale = state
    return _flax_like_update(history, scale)


_RECIPE = jax_fp8.DelayedScaling()


def fused_pytree(state):
    return jax_fp8.update_states(state, recipe=_RECIPE)


def fused_stacked(state):
    return jax_fp8.update_states(state, recipe=_RECIPE)


def copy_floor(state, one):
    history, scale = state
    return history * one, scale * one


def launch_floor_update(state):
    history, scale = state
    new_history, new_scale, _ = jax_fp8.amax_and_scale_update(history, scale)
    return new_history, new_scale


FUNCTIONS = {
    "per_tensor_jnp": per_tensor_jnp,
    "stacked_jnp": stacked_jnp,
    "fused_pytree": fused_pytree,
    "fused_stacked": fused_stacked,
    "floor": copy_floor,
}


def initial_history(n, hist_len, seed=0):
    """A deterministic positive [n, L] history (amaxes of earlier steps)."""
    rng = np.random.default_rng(seed + 7919 * n + hist_len)
    return rng.uniform(0.01, 4.0, size=(n, hist_len)).astype(np.float32)


def make_state(column, base):
    """Fresh device state for `column` from the [N, L] numpy history `base`."""
    n = base.shape[0]
    if column == "per_tensor_jnp":
        return ([jnp.asarray(base[i]) for i in range(n)],
                [jnp.ones((), jnp.float32) for _ in range(n)])
    if column in ("stacked_jnp", "floor"):
        return (jnp.asarray(base), jnp.ones((n,), jnp.float32))
    if column == "fused_pytree":
        return [jax_fp8.ScalingState(jnp.asarray(base[i]), jnp.ones((), jnp.float32),
                                     jnp.ones((), jnp.float32), fp8_dtype=jnp.float8_e4m3fn)
                for i in range(n)]
    if column == "fused_stacked":
        return jax_fp8.ScalingState(jnp.asarray(base), jnp.ones((n,), jnp.float32),
                                    jnp.ones((n,), jnp.float32), fp8_dtype=jnp.float8_e4m3fn)
    raise ValueError(column)


def tree_bytes(tree):
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


# --------------------------------------------------------------------------------------
# Kernels from the compiled HLO text.
# --------------------------------------------------------------------------------------

# Instructions that launch nothing (buffer plumbing, or the second half of a pair
# whose first half is counted).
_FREE_OPCODES = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    "copy-done", "async-done", "async-update", "all-reduce-done", "all-gather-done",
    "collective-permute-done", "send-done", "recv-done",
})
_NESTING_OPCODES = frozenset({"call", "async-start", "while", "conditional"})
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"(?<![\w.%\-])([a-z][a-z0-9\-]*)\(")
_CALLEE_RE = re.compile(
    r"\b(?:to_apply|calls|body|branch_computations|called_computations)="
    r"\{?([^}\s]+(?:,\s*[^}\s]+)*)\}?")


def _strip_shape(rest):
    """'(f32[2], f32[]) fusion(%a), ...' -> 'fusion(%a), ...' (drops the result shape)."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[i + 1:]
        return rest
    return rest.split(" ", 1)[1] if " " in rest else rest


def parse_hlo_computations(hlo_text):
    """HLO text -> ({name: [(opcode, line)]}, entry name)."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if current is None:
            if line and not line[0].isspace():
                m = _HEADER_RE.match(line)
                if m and "->" in line:
                    current = m.group(2)
                    comps[current] = []
                    if m.group(1):
                        entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        op = _OPCODE_RE.search(_strip_shape(m.group(2)))
        if op:
            comps[current].append((op.group(1), line))
    return comps, entry


def count_kernels_hlo(hlo_text):
    """Kernel-launching instructions of the entry computation, by opcode.

    Fusions, custom-calls, copies and every other non-trivial op count one each;
    `call`/`async-start`/`while`/`conditional` are looked into (command buffers,
    async wrappers); fusion bodies are not.
    """
    comps, entry = parse_hlo_computations(hlo_text)
    counts = {}

    def visit(name, depth):
        for opcode, line in comps.get(name, ()):
            if opcode in _FREE_OPCODES:
                continue
            if opcode in _NESTING_OPCODES and depth < 8:
                m = _CALLEE_RE.search(line)
                callees = [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []
                if callees:
                    for callee in callees:
                        visit(callee, depth + 1)
                    continue
            counts[opcode] = counts.get(opcode, 0) + 1

    if entry is not None:
        visit(entry, 0)
    return sum(counts.values()), dict(sorted(counts.items()))


# --------------------------------------------------------------------------------------
# Profiler traces.
# --------------------------------------------------------------------------------------

def _profile_options():
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0  # no Python call events: smaller traces, less overhead
        return opts
    except Exception:  # noqa: BLE001 - an older/newer jax without these options
        return None


def _start_trace(logdir):
    opts = _profile_options()
    if opts is not None:
        try:
            jax.profiler.start_trace(logdir, create_perfetto_trace=True, profiler_options=opts)
            return
        except TypeError:
            pass
    jax.profiler.start_trace(logdir, create_perfetto_trace=True)


def load_trace_events(logdir):
    files = sorted(glob.glob(os.path.join(logdir, "**", "*perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no perfetto_trace.json.gz under {logdir}")
    with gzip.open(files[-1], "rb") as fp:
        trace = json.load(fp)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def traced_kernels(logdir, platform_name):
    """{kernel (GPU) or op (CPU) name: [count, total µs]} of the trace under logdir."""
    summary = summarize_trace(load_trace_events(logdir), platform_name)
    return {} if summary is None else summary["by_name"]


_DERIVED_LINE_RE = re.compile(
    r"XLA Ops|XLA Modules|XLA TraceMe|Framework|TensorFlow|Steps|Source|Launch Stats|"
    r"Name Scope|Async XLA Ops", re.IGNORECASE)


def summarize_trace(events, platform_name):
    """Sums the device time of a trace's events.

    GPU: complete events (ph "X") of the processes whose process_name contains
    "/device:GPU" (the GPU streams; one event per kernel or memcpy), as MEASURING.md
    describes. Threads named like the profiler's derived timelines ("XLA Ops",
    "XLA Modules", "Steps", ...), if a profiler version adds them to the device
    process, are left out so no kernel is counted twice.
    CPU: complete events carrying an `hlo_op` argument (the XLA CPU runtime's op
    events), except their "end: ..." markers.

    Returns dict(total_us, events, by_thread) or None when nothing matched.
    """
    pnames, tnames = {}, {}
    for e in events:
        if e.get("ph") == "M":
            if e.get("name") == "process_name":
                pnames[e.get("pid")] = str(e.get("args", {}).get("name", ""))
            elif e.get("name") == "thread_name":
                tnames[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    if platform_name == "gpu":
        pids = {pid for pid, name in pnames.items() if "/device:GPU" in name}
        if not pids:
            return None
        derived = {k for k, name in tnames.items()
                   if k[0] in pids and _DERIVED_LINE_RE.search(name)}

        def keep(e):
            return e.get("pid") in pids and (e.get("pid"), e.get("tid")) not in derived
    else:
        def keep(e):
            args = e.get("args") or {}
            return "hlo_op" in args and not str(e.get("name", "")).startswith("end: ")
    total, count, by_thread, by_run, by_name = 0.0, 0, {}, {}, {}
    for e in events:
        if e.get("ph") != "X" or not keep(e):
            continue
        dur = float(e.get("dur", 0.0))
        total += dur
        count += 1
        run_id = (e.get("args") or {}).get("run_id")
        by_run[run_id] = by_run.get(run_id, 0.0) + dur
        key = f"{pnames.get(e.get('pid'), e.get('pid'))} / " \
              f"{tnames.get((e.get('pid'), e.get('tid')), e.get('tid'))}"
        slot = by_thread.setdefault(key, [0, 0.0])
        slot[0] += 1
        slot[1] += dur
        named = by_name.setdefault(str(e.get("name", "?")), [0, 0.0])
        named[0] += 1
        named[1] += dur
    if count == 0:
        return None
    # Per-execution totals where the events carry the XLA run_id (the CPU runtime's do).
    run_totals = None if None in by_run else sorted(by_run.values())
    return {"total_us": total, "events": count, "run_totals_us": run_totals,
            "by_thread": {k: {"events": v[0], "us": round(v[1], 3)} for k, v in by_thread.items()},
            "by_name": by_name}


TOP_KERNELS = 40


def traced_device_time(call, state, reps, platform_name, keep_dir=None, top_n=None):
    """Runs `state = call(state)` reps times under the profiler.

    Returns (state, info); info has device_us (per call), events_per_call, or error.
    """
    logdir = tempfile.mkdtemp(prefix="jax_fp8_bench_trace_")
    info = {"trace_reps": reps}
    started = False
    try:
        jax.block_until_ready(state)
        _start_trace(logdir)
        started = True
        for _ in range(reps):
            state = call(state)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        started = False
        summary = summarize_trace(load_trace_events(logdir), platform_name)
        if summary is None:
            info["error"] = "no device events found in the trace"
        else:
            info["device_us_mean"] = summary["total_us"] / reps
            runs = summary["run_totals_us"]
            info["device_us_median"] = (float(np.median(runs)) if runs and len(runs) == reps
                                        else None)
            # GPU: the mean over the R calls, as MEASURING.md measured. CPU: the median
            # over the calls (one preempted op on a shared CPU would swing the mean).
            info["device_us"] = (info["device_us_median"]
                                 if platform_name != "gpu" and info["device_us_median"]
                                 is not None else info["device_us_mean"])
            info["events_per_call"] = summary["events"] / reps
            info["by_thread"] = summary["by_thread"]
            # Where the time goes: the kernels (ops) with the most device time, per call.
            top = sorted(summary["by_name"].items(),
                         key=lambda kv: -kv[1][1])[:top_n or TOP_KERNELS]
            info["top_kernels"] = [{"name": name[:200], "per_call": count / reps,
                                    "us_per_call": round(us / reps, 3)}
                                   for name, (count, us) in top]
    except Exception as err:  # noqa: BLE001 - a measurement must not end the run
        info["error"] = f"{type(err).__name__}: {err}"
        if started:
            try:
                jax.profiler.stop_trace()
            except Exception:  # noqa: BLE001
                pass
    finally:
        if keep_dir:
            try:
                shutil.copytree(logdir, keep_dir, dirs_exist_ok=True)
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(logdir, ignore_errors=True)
    return state, info


# --------------------------------------------------------------------------------------
# One configuration.
# --------------------------------------------------------------------------------------

def _platform():
    p = jax.devices()[0].platform.lower()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def _compile(fn, state, extra):
    jitted = jax.jit(fn, donate_argnums=0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        compiled = jitted.lower(state, *extra).compile()
    return compiled, time.perf_counter() - t0


def _alias_bytes(compiled):
    try:
        ma = compiled.memory_analysis()
        return None if ma is None else int(ma.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend/version reports it
        return None


def _trace_reps(kernels, requested):
    if kernels <= 0:
        return requested
    return int(max(2, min(requested, MAX_TRACE_EVENTS // max(kernels, 1))))


def _skip_column(args, n, hist_len, key, reason):
    args.skipped_columns.append({"n": n, "l": hist_len, "column": key, "reason": reason})
    log(f"  [N={n} L={hist_len}] {key:15s} skipped: {reason}")


def _predict_compile_s(compile_log, key, n):
    """A pessimistic guess of `key`'s compile time at n from its compiles at smaller N.

    Power law through the two largest smaller N (exponent clamped to [1, 3]; 1.5 from
    one point, whose time is mostly fixed overhead), times 2. Compile times that grow
    superlinearly with the number of separate arrays (the per-tensor layouts) are what
    this guards against.
    """
    pts = sorted(p for p in compile_log.get(key, ()) if p[0] < n)
    if not pts:
        return None
    n1, c1 = pts[-1]
    exponent = 1.5
    if len(pts) >= 2:
        n0, c0 = pts[-2]
        if n0 < n1 and c0 > 0 and c1 > 0:
            exponent = min(3.0, max(1.0, math.log(c1 / c0) / math.log(n1 / n0)))
    return 2.0 * c1 * (n / n1) ** exponent


def run_config(n, hist_len, args, platform_name):
    """Measures the five columns at (n, hist_len). Returns a list of result dicts."""
    base = initial_history(n, hist_len)
    one = jnp.ones((), jnp.float32)
    cols = {}
    columns = []
    for key in args.columns:
        limit = args.max_n.get(key)
        if limit is not None and n > limit:
            _skip_column(args, n, hist_len, key, f"--max-n/--per-tensor-max-n {limit}")
            continue
        if args.deadline is not None:
            guess = _predict_compile_s(args.compile_log, key, n)
            left = args.deadline - time.perf_counter()
            if guess is not None and guess > left:
                _skip_column(args, n, hist_len, key,
                             f"predicted compile {guess:.0f} s > {max(left, 0):.0f} s left "
                             f"of --time-limit")
                continue
        columns.append(key)
    for key in list(columns):
        t0 = time.perf_counter()
        try:
            state = make_state(key, base)
            extra = (one,) if key == "floor" else ()
            compiled, compile_s = _compile(FUNCTIONS[key], state, extra)
        except Exception as err:  # noqa: BLE001 - the other columns still run
            traceback.print_exc(file=sys.stderr)
            args.column_failures.append({"n": n, "l": hist_len, "column": key,
                                         "error": f"compile: {type(err).__name__}: {err}"})
            columns.remove(key)
            continue
        args.compile_log.setdefault(key, []).append((n, compile_s))
        kernels, by_opcode = count_kernels_hlo(compiled.as_text())
        cols[key] = {
            "compiled": compiled, "state": state, "extra": extra,
            "row": {"n": n, "l": hist_len, "column": key, "label": dict(COLUMNS)[key],
                    "kernels_hlo": kernels, "kernels_hlo_by_opcode": by_opcode,
                    "compile_s": round(compile_s, 3), "state_bytes": tree_bytes(state),
                    "alias_bytes": _alias_bytes(compiled)},
        }
        log(f"  [N={n} L={hist_len}] {key:15s} compiled in {compile_s:7.2f} s "
            f"(setup {time.perf_counter() - t0 - compile_s:.2f} s), {kernels} kernels in HLO")

    def call_of(key):
        compiled, extra = cols[key]["compiled"], cols[key]["extra"]
        return lambda st: compiled(st, *extra)

    # Warm up (also checks that donation/threading works: the state is replaced).
    for key in list(columns):
        c = cols[key]
        call = call_of(key)
        try:
            for _ in range(args.warmup):
                c["state"] = call(c["state"])
            jax.block_until_ready(c["state"])
        except Exception as err:  # noqa: BLE001 - the other columns still run
            traceback.print_exc(file=sys.stderr)
            args.column_failures.append({"n": n, "l": hist_len, "column": key,
                                         "error": f"run: {type(err).__name__}: {err}"})
            columns.remove(key)
            del cols[key]

    # Wall time. Each column gets a number of calls that fits its share of
    # --wall-seconds (at least --min-calls), timed in --wall-blocks blocks that
    # alternate between the columns, so a slow drift of the machine hits all of them
    # alike. Within a block the column runs back to back, after one untimed call:
    # calling a cheap update right after one that released thousands of buffers
    # measures that release, not the update. The garbage collector is off while
    # timing (as in timeit).
    calls = {key: call_of(key) for key in columns}
    samples = {key: [] for key in columns}
    budget = {}
    for key in columns:
        c = cols[key]
        t0 = time.perf_counter()
        c["state"] = calls[key](c["state"])
        jax.block_until_ready(c["state"])
        est = max(time.perf_counter() - t0, 1e-6)
        budget[key] = int(min(args.max_calls, max(args.min_calls,
                                                  args.wall_seconds / len(columns) / est)))
    blocks = max(1, args.wall_blocks)
    for b in range(blocks):
        for key in columns:
            c = cols[key]
            todo = budget[key] * (b + 1) // blocks - budget[key] * b // blocks
            if todo <= 0:
                continue
            c["state"] = calls[key](c["state"])  # settle (untimed)
            jax.block_until_ready(c["state"])
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                for _ in range(todo):
                    t0 = time.perf_counter()
                    c["state"] = calls[key](c["state"])
                    jax.block_until_ready(c["state"])
                    samples[key].append(time.perf_counter() - t0)
            finally:
                if gc_was_enabled:
                    gc.enable()
    for key in columns:
        s = np.asarray(samples[key]) * 1e6
        cols[key]["row"].update(wall_us_median=float(np.median(s)), wall_us_min=float(s.min()),
                                wall_us_mean=float(s.mean()), wall_calls=int(s.size))

    # Device time from the profiler, one trace per column.
    for key in columns:
        c = cols[key]
        row = c["row"]
        if args.no_trace:
            continue
        reps = _trace_reps(row["kernels_hlo"], args.trace_reps)
        keep = (os.path.join(args.keep_traces, f"N{n}_L{hist_len}_{key}")
                if args.keep_traces else None)
        c["state"], info = traced_device_time(calls[key], c["state"], reps, platform_name, keep)
        row["trace_reps"] = reps
        if "device_us" in info:
            row["device_us"] = info["device_us"]
            row["device_us_mean"] = info["device_us_mean"]
            row["device_us_median"] = info["device_us_median"]
            row["kernels_trace"] = info["events_per_call"]
            row["trace_by_thread"] = info["by_thread"]
        else:
            row["trace_error"] = info.get("error")

    rows = []
    for key in columns:
        row = cols[key]["row"]
        rows.append(row)
        dev = row.get("device_us")
        log(f"  [N={n} L={hist_len}] {key:15s} wall {row['wall_us_median']:10.1f} us "
            f"(median of {row['wall_calls']}), "
            + (f"{'GPU' if platform_name == 'gpu' else 'op'} time {dev:10.2f} us, "
               f"{row['kernels_trace']:g} events/call" if dev is not None
               else f"device time n/a ({row.get('trace_error', 'not traced')})"))
    # Free device memory before the next configuration.
    for key in list(cols):
        jax.tree_util.tree_map(lambda x: x.delete() if hasattr(x, "delete") else None,
                               cols[key]["state"])
    cols.clear()
    return rows


def measure_launch_floor(args, platform_name):
    """jax_fp8.amax_and_scale_update on one tensor with L = 1: one tiny custom call."""
    state = (jnp.full((1,), 2.0, jnp.float32), jnp.ones((), jnp.float32))
    compiled, compile_s = _compile(launch_floor_update, state, ())
    kernels, by_opcode = count_kernels_hlo(compiled.as_text())
    call = lambda st: compiled(st)  # noqa: E731
    for _ in range(max(args.warmup, 3)):
        state = call(state)
    jax.block_until_ready(state)
    samples = []
    for _ in range(max(args.min_calls, 50)):
        t0 = time.perf_counter()
        state = call(state)
        jax.block_until_ready(state)
        samples.append(time.perf_counter() - t0)
    out = {"what": "jax_fp8.amax_and_scale_update, one tensor, L=1, donated",
           "kernels_hlo": kernels, "kernels_hlo_by_opcode": by_opcode,
           "wall_us_median": float(np.median(samples) * 1e6)}
    if not args.no_trace:
        reps = max(args.trace_reps, 50)
        state, info = traced_device_time(call, state, reps, platform_name)
        out["trace_reps"] = reps
        if "device_us" in info:
            out["device_us"] = info["device_us"]
            out["device_us_mean"] = info["device_us_mean"]
            out["device_us_median"] = info["device_us_median"]
            out["kernels_trace"] = info["events_per_call"]
        else:
            out["trace_error"] = info.get("error")
    return out


# --------------------------------------------------------------------------------------
# Ratios, targets, report.
# --------------------------------------------------------------------------------------

RATIOS = (
    # (key, numerator column, denominator column, label)
    ("per_tensor_jnp/fused_pytree", "per_tensor_jnp", "fused_pytree",
     "per-tensor jnp / fused pytree"),
    ("stacked_jnp/fused_pytree", "stacked_jnp", "fused_pytree", "stacked jnp / fused pytree"),
    ("stacked_jnp/fused_stacked", "stacked_jnp", "fused_stacked",
     "stacked jnp / fused stacked"),
    ("fused_pytree/floor", "fused_pytree", "floor", "fused pytree / floor"),
    ("fused_stacked/floor", "fused_stacked", "floor", "fused stacked / floor"),
)


def _index(results):
    return {(r["n"], r["l"], r["column"]): r for r in results}


def _ratio(a, b):
    if a is None or b is None or b <= 0:
        return None
    return a / b


def compute_ratios(results, sizes, lengths):
    idx = _index(results)
    out = []
    for hist_len in lengths:
        for n in sizes:
            entry = {"n": n, "l": hist_len}
            for metric in ("device_us", "wall_us_median"):
                for key, num, den, _ in RATIOS:
                    a = idx.get((n, hist_len, num), {}).get(metric)
                    b = idx.get((n, hist_len, den), {}).get(metric)
                    entry[f"{metric}:{key}"] = _ratio(a, b)
            out.append(entry)
    return out


def _target(name, description, value, op, threshold, metric, unit=""):
    if value is None or threshold is None:
        met = None
    elif op == ">=":
        met = value >= threshold
    elif op == "<=":
        met = value <= threshold
    else:
        met = value == threshold
    return {"name": name, "description": description, "value": value, "op": op,
            "threshold": threshold, "metric": metric, "unit": unit, "met": met}


def evaluate_targets(results, launch_floor, platform_name):
    """The issue's targets, computed from the measured numbers (None: not measured)."""
    idx = _index(results)

    def get(col, metric, n=TARGET_N, hist_len=TARGET_L):
        return idx.get((n, hist_len, col), {}).get(metric)

    targets = []
    at = f"N={TARGET_N}, L={TARGET_L}"
    if platform_name == "gpu":
        fp = get("fused_pytree", "device_us")
        floor = get("floor", "device_us")
        lf = (launch_floor or {}).get("device_us")
        kh = get("fused_pytree", "kernels_hlo")
        kt = get("fused_pytree", "kernels_trace")
        targets.append(_target("gpu_one_kernel", f"{at}: fused pytree launches 1 kernel (HLO)",
                               kh, "==", 1, "kernels_hlo"))
        targets.append(_target("gpu_one_kernel_trace",
                               f"{at}: fused pytree runs 1 GPU kernel per update (trace)",
                               kt, "==", 1, "kernels_trace"))
        bound = None if floor is None or lf is None else 1.5 * (floor + lf)
        targets.append(_target(
            "gpu_near_floor", f"{at}: fused pytree GPU time <= 1.5 x (copy floor + launch floor)"
            + ("" if bound is None else f" = {bound:.2f} us"),
            fp, "<=", bound, "device_us", "us"))
        targets.append(_target("gpu_vs_per_tensor_jnp",
                               f"{at}: per-tensor jnp / fused pytree GPU time >= 1000",
                               _ratio(get("per_tensor_jnp", "device_us"), fp), ">=", 1000.0,
                               "device_us", "x"))
        targets.append(_target("gpu_vs_stacked_jnp",
                               f"{at}: stacked jnp / fused pytree GPU time >= 2.5",
                               _ratio(get("stacked_jnp", "device_us"), fp), ">=", 2.5,
                               "device_us", "x"))
    else:
        lengths = sorted({r["l"] for r in results if r["n"] == TARGET_N})
        if not lengths:
            lengths = [TARGET_L]
        for hist_len in lengths:
            where = f"N={TARGET_N}, L={hist_len}"
            for metric, what in (("wall_us_median", "wall"), ("device_us", "CPU op time")):
                targets.append(_target(
                    f"cpu_pytree_vs_per_tensor_jnp_L{hist_len}_{what.split()[0].lower()}",
                    f"{where}: per-tensor jnp / fused pytree {what} >= 10",
                    _ratio(get("per_tensor_jnp", metric, hist_len=hist_len),
                           get("fused_pytree", metric, hist_len=hist_len)),
                    ">=", 10.0, metric, "x"))
                targets.append(_target(
                    f"cpu_stacked_not_slower_L{hist_len}_{what.split()[0].lower()}",
                    f"{where}: fused stacked not slower than stacked jnp "
                    f"(stacked jnp / fused stacked {what} >= 1)",
                    _ratio(get("stacked_jnp", metric, hist_len=hist_len),
                           get("fused_stacked", metric, hist_len=hist_len)),
                    ">=", 1.0, metric, "x"))
    return targets


def _fmt_time(us):
    if us is None:
        return "n/a"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    if us >= 100:
        return f"{us:.0f} µs"
    if us >= 10:
        return f"{us:.1f} µs"
    return f"{us:.2f} µs"


def _fmt_ratio(x):
    if x is None:
        return "n/a"
    if x >= 100:
        return f"{x:,.0f}×"
    if x >= 10:
        return f"{x:.1f}×"
    return f"{x:.2f}×"


def _fmt_kernels(r):
    kh = r.get("kernels_hlo")
    kt = r.get("kernels_trace")
    if kt is None:
        return f"{kh}"
    kt_s = f"{kt:g}" if float(kt).is_integer() else f"{kt:.1f}"
    return f"{kh}" if str(kh) == kt_s else f"{kh} / {kt_s}"


def markdown_report(data):
    meta = data["meta"]
    results = data["results"]
    sizes, lengths = meta["settings"]["sizes"], meta["settings"]["lengths"]
    cols = meta["settings"]["columns"]
    idx = _index(results)
    gpu = meta["platform"] == "gpu"
    dev_name = "GPU time" if gpu else "CPU op time"
    lines = []
    lines.append(f"- Device: {meta['device']} ({meta['platform']}), jax {meta['jax_version']}, "
                 f"jaxlib {meta['jaxlib_version']}, jax_fp8 {meta['jax_fp8_version']} "
                 f"(CPU kernel: {meta['has_cpu_kernel']}, CUDA kernel: {meta['has_cuda_kernel']})")
    if meta.get("machine"):
        lines.append(f"- Host: {meta['machine']}, Python {meta.get('python', '?')}, "
                     f"git {meta.get('git_commit') or '?'}, sources {meta.get('source_digest') or '?'}")
    lines.append(f"- Date: {meta['date']}")
    lines.append(f"- Command: `{meta['command']}`")
    lines.append("")
    header = "| N | L | " + " | ".join(SHORT_LABELS[c] for c in cols) + " |"
    sep = "|---:|---:|" + "---:|" * len(cols)

    def table(title, cell):
        lines.append(f"**{title}**")
        lines.append("")
        lines.append(header)
        lines.append(sep)
        for hist_len in lengths:
            for n in sizes:
                cells = []
                for c in cols:
                    r = idx.get((n, hist_len, c))
                    cells.append("—" if r is None else cell(r))
                lines.append(f"| {n} | {hist_len} | " + " | ".join(cells) + " |")
        lines.append("")

    any_dev = any(r.get("device_us") is not None for r in results)
    table("Kernels launched per update (compiled HLO" + (" / trace events" if gpu else "")
          + ")", lambda r: _fmt_kernels(r) if gpu else f"{r['kernels_hlo']}")
    if any_dev:
        table(f"{dev_name} per update (profiler trace: "
              + ("sum of GPU-stream kernel durations over R calls / R"
                 if gpu else "XLA CPU op durations of one call, median over R calls")
              + ")", lambda r: _fmt_time(r.get("device_us")))
    table("Wall time per jitted call (median, block_until_ready each)",
          lambda r: _fmt_time(r.get("wall_us_median")))
    table("Compile time (lower + compile, once per configuration)",
          lambda r: "n/a" if r.get("compile_s") is None else f"{r['compile_s']:.2f} s")

    present = [(k, num, den, label) for k, num, den, label in RATIOS
               if num in cols and den in cols]
    for metric, name in (("device_us", dev_name), ("wall_us_median", "wall time")):
        if metric == "device_us" and not any_dev:
            continue
        if not present:
            break
        lines.append(f"**Ratios ({name})**")
        lines.append("")
        lines.append("| N | L | " + " | ".join(p[3] for p in present) + " |")
        lines.append("|---:|---:|" + "---:|" * len(present) + "")
        for entry in data["ratios"]:
            lines.append(f"| {entry['n']} | {entry['l']} | "
                         + " | ".join(_fmt_ratio(entry.get(f"{metric}:{p[0]}"))
                                      for p in present) + " |")
        lines.append("")

    lf = data.get("launch_floor")
    if lf:
        lines.append(f"**Launch floor** ({lf['what']}): {lf['kernels_hlo']} kernel(s) in HLO, "
                     f"{dev_name} {_fmt_time(lf.get('device_us'))}, "
                     f"wall {_fmt_time(lf.get('wall_us_median'))}")
        lines.append("")

    lines.append("**Targets**")
    lines.append("")
    for t in data["targets"]:
        if t["met"] is None:
            verdict = "NOT MEASURED"
        else:
            verdict = "MET" if t["met"] else "NOT MET"
        if t["value"] is None:
            val = "n/a"
        elif t["unit"] == "x":
            val = _fmt_ratio(t["value"])
        elif t["unit"] == "us":
            val = _fmt_time(t["value"])
        else:
            val = f"{t['value']:g}"
        lines.append(f"- [{verdict}] {t['description']}: measured {val}")
    lines.append("")
    if data.get("skipped"):
        lines.append("Configurations skipped (time limit): " + ", ".join(
            f"N={s['n']} L={s['l']}" for s in data["skipped"]))
        lines.append("")
    if data.get("skipped_columns"):
        lines.append("Columns skipped (— in the tables): " + "; ".join(
            f"{s['column']} at N={s['n']} L={s['l']} ({s['reason']})"
            for s in data["skipped_columns"]))
        lines.append("")
    for f in data.get("failures") or ():
        where = "launch floor" if f.get("launch_floor") else (
            f"N={f.get('n')} L={f.get('l')}" + (f" {f['column']}" if f.get("column") else ""))
        lines.append(f"FAILED {where}: {f['error']}")
    if data.get("failures"):
        lines.append("")
    lines.append(f"Total run time: {meta.get('total_s', '?')} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------------------

def _int_list(text):
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _column_list(text):
    values = [v for v in text.replace(" ", "").split(",") if v]
    bad = [v for v in values if v not in COLUMN_KEYS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown column(s) {bad}; choose from {COLUMN_KEYS}")
    return [k for k in COLUMN_KEYS if k in values]


def build_parser():
    p = argparse.ArgumentParser(
        description="Benchmark jax_fp8's fused FP8 scaling update against the per-tensor and "
                    "stacked jax.numpy updates and a copy floor (see bench/README.md).",
        epilog=__doc__[__doc__.index("Examples:"):],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_int_list, default=None,
                   help="comma-separated numbers of FP8 tensors N "
                        f"(default {','.join(map(str, DEFAULT_SIZES))}; "
                        f"--quick: {','.join(map(str, QUICK_SIZES))})")
    p.add_argument("--lengths", type=_int_list, default=None,
                   help="comma-separated history lengths L "
                        f"(default {','.join(map(str, DEFAULT_LENGTHS))})")
    p.add_argument("--columns", type=_column_list, default=list(COLUMN_KEYS),
                   help="comma-separated subset of " + ",".join(COLUMN_KEYS) + " (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and fewer repetitions (a few seconds to a minute)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per column "
                   "(default 3; --quick 1)")
    p.add_argument("--min-calls", type=int, default=None,
                   help="minimum timed calls per column for the wall time (default 10; --quick 3)")
    p.add_argument("--max-calls", type=int, default=None,
                   help="maximum timed calls per column (default 2000; --quick 100)")
    p.add_argument("--wall-seconds", type=float, default=None,
                   help="wall-time budget per configuration, shared by the columns; a column "
                        "gets max(--min-calls, its share / its call time) calls, at most "
                        "--max-calls (default 1.5; --quick 0.3)")
    p.add_argument("--wall-blocks", type=int, default=None,
                   help="timed blocks per column, alternating between the columns "
                        "(default 4; --quick 2)")
    p.add_argument("--trace-reps", type=int, default=None,
                   help="calls R in each profiler trace (lowered for configurations with very "
                        f"many kernels to keep each trace under ~{MAX_TRACE_EVENTS} events; "
                        "default 20; --quick 5)")
    p.add_argument("--per-tensor-max-n", type=int, default=None, metavar="N",
                   help="skip the two per-tensor layouts (per_tensor_jnp, fused_pytree) for N "
                        "above this: their compile times grow faster than linearly with the "
                        "number of separate arrays; the other columns are still measured")
    p.add_argument("--max-n", action="append", default=[], metavar="COLUMN=N",
                   help="skip COLUMN for N above this (repeatable; overrides "
                        "--per-tensor-max-n for that column)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no new configuration after this many seconds, and skip a "
                        "column whose compile time, extrapolated from smaller N, would not "
                        "fit in the time left (skips are listed; results so far are "
                        "reported and written)")
    p.add_argument("--no-trace", action="store_true",
                   help="skip the profiler traces (no GPU/CPU op time; wall time only)")
    p.add_argument("--no-launch-floor", action="store_true",
                   help="skip the launch-floor measurement")
    p.add_argument("--keep-traces", metavar="DIR", default=None,
                   help="copy every profiler trace under DIR")
    p.add_argument("--out", metavar="JSON", default=None,
                   help="write the results as JSON (also rewritten after every "
                   "configuration, so an interrupted run keeps what it measured)")
    p.add_argument("--from-json", metavar="JSON", default=None,
                   help="measure nothing: print the report of a results JSON (also a partial "
                        "one from an interrupted run) and write --out/--outdir from it")
    p.add_argument("--outdir", metavar="DIR", default=None,
                   help="write DIR/results.json, DIR/results.md and DIR/bench_update.png")
    return p


def _finalize_args(args):
    quick = args.quick
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES if quick else DEFAULT_SIZES)
    if args.lengths is None:
        args.lengths = list(DEFAULT_LENGTHS)
    defaults = dict(warmup=(1, 3), min_calls=(3, 10), max_calls=(100, 2000),
                    wall_seconds=(0.3, 1.5), wall_blocks=(2, 4), trace_reps=(5, 20))
    for name, (q, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, q if quick else full)
    max_n = {}
    if args.per_tensor_max_n is not None:
        max_n = {"per_tensor_jnp": args.per_tensor_max_n, "fused_pytree": args.per_tensor_max_n}
    for item in args.max_n:
        key, _, value = item.partition("=")
        if key not in COLUMN_KEYS or not value.strip().isdigit():
            raise SystemExit(f"--max-n expects COLUMN=N with COLUMN in {COLUMN_KEYS}, "
                             f"got {item!r}")
        max_n[key] = int(value)
    args.max_n = max_n
    args.compile_log = {}
    args.skipped_columns = []
    args.column_failures = []
    args.deadline = None
    args.min_calls = max(1, args.min_calls)
    args.max_calls = max(args.min_calls, args.max_calls)
    args.trace_reps = max(1, args.trace_reps)
    args.warmup = max(0, args.warmup)
    return args


def _git_commit():
    """HEAD, with "+dirty" when the tracked files differ from it (a copied working tree,
    as on the device machine, may carry an older .git: see source_digest)."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=10)
        head = out.stdout.strip() or None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=here,
                               capture_output=True, timeout=30).returncode == 1
        return f"{head}+dirty" if head and dirty else head
    except Exception:  # noqa: BLE001
        return None


def source_digest():
    """sha256 (12 hex digits) of the sources that decide a measurement: ffi/, jax_fp8/
    and bench/*.py. The same digest at a commit means the same code ran
    (`python -c "import bench_update; print(bench_update.source_digest())"` in bench/)."""
    import hashlib
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    h = hashlib.sha256()
    for sub, exts in (("ffi", (".h", ".cc", ".cu")), ("jax_fp8", (".py",)),
                      ("bench", (".py",))):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, sub))):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(exts):
                    path = os.path.join(dirpath, f)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as fp:
                        h.update(fp.read())
    return h.hexdigest()[:12]


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as fp:
            for line in fp:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def environment_meta(script, argv):
    """What ran where (device, versions, machine, commit, date, command): the part of a
    benchmark's metadata that every benchmark script records."""
    dev = jax.devices()[0]
    try:
        import jaxlib
        jaxlib_version = jaxlib.__version__
    except Exception:  # noqa: BLE001
        jaxlib_version = None
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": _platform(),
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib_version,
        "jax_fp8_version": getattr(jax_fp8, "__version__", None),
        "has_cpu_kernel": bool(getattr(jax_fp8, "HAS_CPU_KERNEL", False)),
        "has_cuda_kernel": bool(getattr(jax_fp8, "HAS_CUDA_KERNEL", False)),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {_cpu_model()}, "
                   f"{os.cpu_count()} CPU cores",
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "git_commit": _git_commit(),
        "source_digest": source_digest(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": shlex.join(["python", os.path.relpath(os.path.abspath(script))] + list(argv)),
    }


def collect_meta(args, argv):
    return {
        **environment_meta(__file__, argv),
        "settings": {k: getattr(args, k) for k in (
            "sizes", "lengths", "columns", "quick", "warmup", "min_calls", "max_calls",
            "wall_seconds", "wall_blocks", "trace_reps", "no_trace", "max_n", "time_limit")},
        "notes": {
            "per_tensor_jnp": "Flax fp8_ops arithmetic (jnp.max, jnp.where x2, 1/x, jnp.roll, "
                              ".at[0].set(0)) per tensor on a (L,) history + scalar, one jit",
            "floor": "history * one, scale * one over [N, L] + [N] (one: runtime scalar)",
            "device_us": "GPU: sum of GPU-stream kernel durations in a perfetto trace / R "
                         "(device_us_mean); CPU: median over the R calls of the sum of the "
                         "XLA CPU runtime's op (thunk) durations per call (device_us_median; "
                         "device_us_mean is the sum / R)",
            "kernels_hlo": "non-trivial instructions in the compiled entry computation",
        },
    }


def run(argv=None):
    """Runs the benchmark; returns the result dict (also written/printed per the flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _finalize_args(build_parser().parse_args(argv))
    if args.from_json:
        return rerender(args.from_json, args.out, args.outdir)
    platform_name = _platform()
    meta = collect_meta(args, argv)
    log(f"jax_fp8 bench: {meta['device']} ({platform_name}), jax {meta['jax_version']}, "
        f"sizes {args.sizes}, lengths {args.lengths}, columns {args.columns}")
    if platform_name == "gpu" and not meta["has_cuda_kernel"]:
        log("WARNING: jax_fp8's CUDA kernel is not loaded; the fused columns run the jnp "
            "fallback")
    if platform_name == "cpu" and not meta["has_cpu_kernel"]:
        log("WARNING: jax_fp8's CPU kernel is not loaded; the fused columns run the jnp fallback")
    t_all = time.perf_counter()
    if args.time_limit is not None:
        args.deadline = t_all + args.time_limit
    results = []
    failures = []
    skipped = []
    out_json = args.out
    if args.outdir:
        os.makedirs(args.outdir, exist_ok=True)
        out_json = out_json or os.path.join(args.outdir, "results.json")
    for hist_len in args.lengths:
        for n in args.sizes:
            attempted = bool(results or failures)  # the first configuration always runs
            if (args.time_limit is not None and attempted
                    and time.perf_counter() - t_all > args.time_limit):
                skipped.append({"n": n, "l": hist_len})
                log(f"[N={n} L={hist_len}] skipped (--time-limit {args.time_limit:g} s)")
                continue
            t0 = time.perf_counter()
            log(f"[N={n} L={hist_len}] ...")
            try:
                results.extend(run_config(n, hist_len, args, platform_name))
            except Exception as err:  # noqa: BLE001 - keep the other configurations
                traceback.print_exc(file=sys.stderr)
                failures.append({"n": n, "l": hist_len, "error": f"{type(err).__name__}: {err}"})
                log(f"[N={n} L={hist_len}] FAILED: {err}")
            log(f"[N={n} L={hist_len}] done in {time.perf_counter() - t0:.1f} s "
                f"(total {time.perf_counter() - t_all:.1f} s)")
            if out_json:  # partial results survive an interrupted run
                _write_json(out_json, {"meta": meta, "results": results, "partial": True,
                                       "failures": args.column_failures + failures,
                                       "skipped": skipped,
                                       "skipped_columns": args.skipped_columns})
    launch_floor = None
    if not args.no_launch_floor:
        try:
            launch_floor = measure_launch_floor(args, platform_name)
            log(f"launch floor: {launch_floor['kernels_hlo']} kernel(s), "
                f"device time {launch_floor.get('device_us')}, wall "
                f"{launch_floor['wall_us_median']:.1f} us")
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            failures.append({"launch_floor": True, "error": f"{type(err).__name__}: {err}"})
    meta["total_s"] = round(time.perf_counter() - t_all, 1)
    failures = args.column_failures + failures
    data = assemble(meta, results, launch_floor, failures, skipped, args.skipped_columns)
    if out_json:
        _write_json(out_json, data)
        log(f"wrote {out_json}")
    _write_extras(data, args.outdir, out_json)
    print(data["report_markdown"])
    return data


def assemble(meta, results, launch_floor, failures=(), skipped=(), skipped_columns=()):
    """The full result dict (ratios, targets, markdown report) from the measurements."""
    settings = meta["settings"]
    data = {"meta": meta,
            "columns": [{"key": k, "label": v} for k, v in COLUMNS if k in settings["columns"]],
            "results": list(results), "launch_floor": launch_floor,
            "ratios": compute_ratios(results, settings["sizes"], settings["lengths"]),
            "targets": evaluate_targets(results, launch_floor, meta["platform"]),
            "failures": list(failures), "skipped": list(skipped),
            "skipped_columns": list(skipped_columns)}
    data["report_markdown"] = markdown_report(data)
    return data


def _write_extras(data, outdir, out_json):
    """DIR/results.md and DIR/bench_update.png (the PNG only where matplotlib is)."""
    if not outdir:
        return
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "results.md"), "w") as fp:
        fp.write(data["report_markdown"] + "\n")
    png = os.path.join(outdir, "bench_update.png")
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import plot as bench_plot
        bench_plot.plot(data, png)
        log(f"wrote {png}")
    except ImportError as err:
        log(f"no PNG ({err}); draw it elsewhere with: python bench/plot.py "
            f"{out_json or 'results.json'} --png bench_update.png")
    except Exception as err:  # noqa: BLE001 - the numbers are written already
        traceback.print_exc(file=sys.stderr)
        log(f"plotting failed: {err}")


def rerender(path, out_json=None, outdir=None):
    """Report (and --outdir files) from a results JSON, also a partial one."""
    with open(path) as fp:
        saved = json.load(fp)
    data = assemble(saved["meta"], saved.get("results", []), saved.get("launch_floor"),
                    saved.get("failures", []), saved.get("skipped", []),
                    saved.get("skipped_columns", []))
    if saved.get("partial"):
        data["partial"] = True
        data["report_markdown"] = ("(partial results: the run was interrupted)\n\n"
                                   + data["report_markdown"])
    if outdir and not out_json:
        out_json = os.path.join(outdir, "results.json")
    if out_json:
        _write_json(out_json, data)
    _write_extras(data, outdir, out_json)
    print(data["report_markdown"])
    return data


def _write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fp:
        json.dump(data, fp, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if not math.isfinite(float(x)) else float(x)
    return str(x)


def main(argv=None):
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
