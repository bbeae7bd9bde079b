#!/usr/bin/env python3
"""Benchmark: a decoder's training step, bf16 vs Flax FP8 vs jax_fp8's recipes.

The model (plain Flax linen, written here): token embedding; per block RMSNorm, fused QKV
projection, rotary position embedding, causal attention (``jax.nn.dot_product_attention``,
cuDNN on a GPU), output projection, residual; RMSNorm, fused gate/up projection, SwiGLU,
down projection, residual; final RMSNorm, LM head, cross-entropy; ``optax.adamw``; float32
parameters, bf16 compute, the train state donated, the blocks unrolled (``--scan``:
``nn.scan``). The four projections of each block are the FP8 GEMMs; the LM head stays
bf16 (``--fp8-lm-head`` makes it FP8 too). Sizes (SIZES below):

  tiny      d 128, 2 heads, ffn 256, 2 blocks, 2 x 64 tokens, vocab 512 (CPU, seconds)
  350m      d 1024, 16 heads, ffn 2816, 24 blocks, 8 x 2048 tokens, vocab 32000
  1b        d 2048, 16 heads, ffn 5632, 16 blocks, 4 x 2048 tokens, vocab 32000
  8b_slice  d 4096, 32 heads, ffn 14336, 4 blocks, 2 x 4096 tokens, vocab 32000

and two architectures written without FP8, as their authors write them, that jax_fp8's
variants convert with ``jax_fp8.flax.fp8_model`` (llm_models.py): gemma3_1b (Flax's Gemma
example's Gemma 3 1B: head-split einsums, one KV head, QK-norm, pre/post norms, sliding
window, tied LM head) and qwen3_1.7b (grouped-query attention, QK-norm, untied 152k head),
each with a CPU-sized ``*_tiny``.

Variants (VARIANTS below; a new one, e.g. with fused kernels, is one entry):

  bf16              nn.Dense
  flax_fp8          nn.Dense(dot_general_cls=flax.linen.fp8_ops.Fp8DirectDotGeneralOp),
                    the FP8 variables in Flax's "_overwrite_with_gradient" collection,
                    written by flax.training's TrainState.apply_gradients
  jax_fp8_delayed   nn.Dense(dot_general_cls=jax_fp8.flax.Fp8DotGeneral) + Fp8TrainState,
                    DelayedScaling
  jax_fp8_current   the same with Float8CurrentScaling
  jax_fp8_block     the same with Float8BlockScaling

and, run only when named, jax_fp8_delayed with one piece of its layout work handed back
to XLA's own ops (XLA_PIECES below), to measure what each of its kernels saves:

  jax_fp8_delayed_xla_gradient_cast     the incoming gradient's FP8 copy and amax by XLA
                                        (fused into the gradient's producer), not the
                                        quantize + transpose kernel
  jax_fp8_delayed_xla_kernel_rotation   the forward GEMM's FP8 kernel transposed by XLA
  jax_fp8_delayed_xla_layouts           no layout kernel at all: every FP8 transpose and
                                        the gradient's cast by XLA

Each variant runs in its own process (this script with --worker), so its compile is a
cold one and no variant sees another's autotuning. Per size and variant: device time per
step (the sum of the GPU kernel durations in a profiler trace of --steps steps / steps),
split by kernel family (FP8 GEMM, bf16 GEMM, attention, norm+quantize, act+quantize,
quantize/transpose, amax, jax_fp8 kernels, other; FAMILY_NOTE below); pipelined wall time
(--steps steps dispatched back to back, one block at the end) and blocked wall time (the median of
--steps steps each followed by block_until_ready), after --warmup steps; tokens/s; lower
+ compile time; ``compiled.memory_analysis().temp_size_in_bytes``; the device's peak memory
in use (``memory_stats()``, where the backend reports it); the speed-ups vs bf16
and vs Flax FP8; and each FP8 variant's floor: its own GEMM time + bf16's attention time +
bf16's other (non-GEMM, non-attention) time, i.e. the step if FP8 added nothing but its
GEMMs. On a CPU there are no GPU kernels: device time is reported unavailable, the XLA:CPU
op time by family stands in for the family split, and the wall times are measured.

Progress goes to stderr, the markdown report to stdout; OUTDIR/results.json,
OUTDIR/results.md and OUTDIR/plot.png are rewritten after every variant (an interrupted
run keeps what it measured).

Examples:
  python bench/bench_llm.py --outdir out/bench_llm                  # 1b and 8b_slice, 5 variants
  python bench/bench_llm.py --sizes 8b_slice --variants bf16,jax_fp8_delayed --steps 20
  python bench/bench_llm.py --sizes tiny --variants bf16,jax_fp8_delayed --steps 2   # CPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import common
import jax_fp8
from jax_fp8.devtools import compilation, hlo, trace
from llm_kernels import (
    FAMILIES,
    FAMILY_NOTE,
    FLOOR_NOTE,
    analyze,
    gemm_table,
    split_by_family,
    time_fp8_gemm_alone,
)
from llm_models import (
    DEFAULT_SIZES,
    DEFAULT_VARIANTS,
    SIZES,
    VARIANTS,
    attention_impl,
    hand_to_xla,
    make_state,
    step_function,
)
from llm_report import TIMES, derive, markdown, plot

# --------------------------------------------------------------------------------------
# One variant at one size, in this process (--worker).
# --------------------------------------------------------------------------------------

def log(msg):
    print(msg, file=sys.stderr, flush=True)


def measure(variant, size, args, progress=log):
    """Measures ``variant`` at ``size`` in this process; returns its result row."""
    tag = f"{size.name} {variant.name}"
    platform = common.platform_name()
    row = {"size": size.name, "variant": variant.name, "label": variant.label,
           "kind": variant.kind, "platform": platform,
           "environment": common.environment(__file__, sys.argv[1:]),
           "config": dataclasses.asdict(size), "tokens": size.tokens,
           "params": size.params(), "model_tflop_per_step": size.flops_per_step() / 1e12,
           "attention_impl": attention_impl(args), "scan": args.scan,
           "fp8_lm_head": args.fp8_lm_head, "rope": not args.no_rope}
    rng = np.random.default_rng(args.seed)
    seqs = rng.integers(0, size.vocab, (size.batch, size.seq + 1), dtype=np.int32)
    tokens, labels = jnp.asarray(seqs[:, :-1]), jnp.asarray(seqs[:, 1:])

    errors = []
    t0 = time.perf_counter()
    state = jax.block_until_ready(make_state(variant, size, args, tokens))
    row["init_s"] = time.perf_counter() - t0
    row["state_arrays"] = len(jax.tree.leaves(state))
    progress(f"{tag}: state ready in {row['init_s']:.1f} s; lowering and compiling")

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        t0 = time.perf_counter()
        lowered = jax.jit(step_function(variant), donate_argnums=(0,)).lower(state, tokens,
                                                                             labels)
        row["lower_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = time.perf_counter() - t0
    row["lower_compile_s"] = row["lower_s"] + row["compile_s"]
    row["memory"] = compilation.memory(compiled)
    row["temp_bytes"] = row["memory"].get("temp_size_in_bytes")
    t0 = time.perf_counter()
    mod = hlo.parse(compiled.as_text())
    row["hlo"], families, kernel_bytes, gemms = analyze(mod)
    del mod, lowered
    row["analysis_s"] = time.perf_counter() - t0
    progress(f"{tag}: lowered in {row['lower_s']:.1f} s, compiled in {row['compile_s']:.1f} s, "
             f"temp {row['temp_bytes'] or 0:,} bytes; {row['hlo']['gemms_fp8']} FP8 GEMMs, "
             f"{row['hlo']['gemms_other']} other GEMMs")
    if variant.update_calls is not None and row["hlo"]["jax_fp8_update"] != variant.update_calls:
        errors.append(f"expected {variant.update_calls} jax_fp8_update custom call(s), found "
                      f"{row['hlo']['jax_fp8_update']} (kernels loaded: CPU "
                      f"{jax_fp8.HAS_CPU_KERNEL}, CUDA {jax_fp8.HAS_CUDA_KERNEL})")

    def step(s):
        return compiled(s, tokens, labels)

    t0 = time.perf_counter()
    state, times, losses = common.time_steps(step, state, args)
    row.update(times)
    row["steps_s"] = time.perf_counter() - t0
    row["tokens_per_s"] = size.tokens / (row["pipelined_ms"] / 1e3)
    progress(f"{tag}: pipelined {row['pipelined_ms']:.2f} ms, blocked "
             f"{row['blocked_ms']:.2f} ms per step; tracing {args.steps} steps")

    t0 = time.perf_counter()
    state, events = trace.capture(lambda s: step(s)[0], state, steps=args.steps)
    if platform == "gpu":
        dev = trace.device_events(events, platform="gpu")
        if dev:
            row["device_ms"] = trace.total_us(dev) / args.steps / 1e3
            row["events_per_step"] = len(dev) / args.steps
            (row["families_ms"], row["classified_by"], row["top_kernels"],
             row["families_bandwidth"]) = split_by_family(dev, families, args.steps,
                                                          args.top_kernels, kernel_bytes)
            row["gemms"] = gemm_table(dev, gemms, args.steps)
            if args.gemms_alone:
                for g in row["gemms"]["rows"]:
                    if g["fp8"]:
                        g["alone"] = time_fp8_gemm_alone(g, args.steps)
            row["tokens_per_s_device"] = size.tokens / (row["device_ms"] / 1e3)
            row["model_tflops_device"] = size.flops_per_step() / (row["device_ms"] / 1e3) / 1e12
        else:
            row["device_time_note"] = "no GPU kernel events in the profiler trace"
    else:
        row["device_time_note"] = (f"device time unavailable on {platform}: the trace has no "
                                   "GPU kernels")
        ops = trace.device_events(events, platform="cpu")
        if ops:
            row["cpu_op_families_ms"], _, row["top_ops"], _ = split_by_family(
                ops, families, args.steps, args.top_kernels)
            row["cpu_gemms"] = gemm_table(ops, gemms, args.steps)
    del events
    row["trace_s"] = time.perf_counter() - t0
    row["device_ms"] = row.get("device_ms")
    # Peak device memory of this process (one variant per process): the state, the compiled
    # step's buffers and the profiler's, as the allocator saw them.
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_bytes"] = stats.get("peak_bytes_in_use")
    row["loss_first"], row["loss_last"] = losses[0], losses[-1]
    row["loss_finite"] = all(math.isfinite(v) for v in losses)
    if not row["loss_finite"]:
        errors.append(f"a non-finite loss: {losses}")
    if errors:
        row["check_error"] = "; ".join(errors)
    return row


def worker(args):
    """--worker: one size and variant, the row written to --result as JSON."""
    (size_name,), (name,) = args.sizes, args.variants
    for piece in VARIANTS[name].xla_pieces:
        hand_to_xla(piece)
    common.write_json(args.result, measure(VARIANTS[name], SIZES[size_name], args))
    return 0


# --------------------------------------------------------------------------------------
# The plan: one worker process per size and variant.
# --------------------------------------------------------------------------------------

WORKER_OPTIONS = ("steps", "warmup", "history_len", "lr", "seed", "top_kernels", "attention",
                  "min_fp8_flops", "keep_bf16")
WORKER_FLAGS = ("scan", "fp8_lm_head", "no_rope", "gemms_alone")


def worker_env():
    """This process's environment without JAX's persistent compilation cache or XLA's
    autotune caches: every worker compiles cold."""
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", PYTHONUNBUFFERED="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cached = re.compile(r"--xla_gpu_(per_fusion_autotune_cache_dir|load_autotune_results_from)")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not cached.match(f))
    return env


def run_worker(size, variant, args, timeout):
    """Runs one worker process; returns (row, check errors). Its output is passed on to
    stderr, indented, as it comes."""
    with tempfile.TemporaryDirectory(prefix="bench_llm_") as tmp:
        result = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--result", result,
               "--sizes", size.name, "--variants", variant.name]
        for opt in WORKER_OPTIONS:
            if getattr(args, opt) is not None:
                cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
        cmd += [f"--{f.replace('_', '-')}" for f in WORKER_FLAGS if getattr(args, f)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        tail = collections.deque(maxlen=40)

        def forward():
            for line in proc.stdout:
                tail.append(line.rstrip())
                print("    " + line.rstrip(), file=sys.stderr, flush=True)
        reader = threading.Thread(target=forward, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(5)
            raise RuntimeError(
                f"timed out after {timeout:.0f} s (--timeout-per-variant)") from None
        reader.join(5)
        if rc != 0 or not os.path.exists(result):
            raise RuntimeError(f"worker exited {rc}: {_last_error(tail)}")
        with open(result) as fp:
            row = json.load(fp)
    row["process_s"] = time.perf_counter() - t0
    return row, [row["check_error"]] if row.get("check_error") else []


def _last_error(lines) -> str:
    """The last exception line of a worker's output (else its last line)."""
    lines = [ln.strip() for ln in lines if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)]
    return (errors or lines or ["no output"])[-1][:2000]



def save_plot(data, outdir):
    png = os.path.join(outdir, "plot.png")
    try:
        plot(data, png)
    except ImportError as err:
        log(f"no plot ({err}): matplotlib is missing")


# --------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------

def _flops_or_auto(text):
    return text if text == "auto" else float(text)


def build_parser():
    p = common.arg_parser("A Llama-style decoder's training step: bf16, Flax FP8 and jax_fp8's "
                          "recipes side by side, one process each (bench/README.md).", __doc__)
    p.add_argument("--sizes", type=common.subset_of(SIZES, "sizes"),
                   default=list(DEFAULT_SIZES),
                   help=f"comma-separated subset of {','.join(SIZES)} (default: "
                        f"{','.join(DEFAULT_SIZES)})")
    p.add_argument("--variants", type=common.subset_of(VARIANTS, "variants"),
                   default=list(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: "
                        f"{','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--steps", type=int, default=10,
                   help="steps blocked, pipelined and traced, each (10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (3)")
    p.add_argument("--timeout-per-variant", type=float, default=300,
                   help="seconds one worker process may take before it is stopped (300)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting workers once this much time is spent, and cut each "
                        "worker's timeout to what is left (default: no limit)")
    p.add_argument("--history-len", type=int, default=1024,
                   help="amax history length, Flax and jax_fp8 delayed alike (1024)")
    p.add_argument("--lr", type=float, default=1e-4, help="adamw learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", choices=("auto", "cudnn", "xla"), default="auto",
                   help="jax.nn.dot_product_attention's implementation (auto: cudnn on a GPU, "
                        "xla elsewhere)")
    p.add_argument("--scan", action="store_true", help="nn.scan over the blocks (not unrolled)")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="the LM head with the variant's FP8 dot_general too (default bf16)")
    p.add_argument("--no-rope", action="store_true", help="no rotary position embedding")
    p.add_argument("--min-fp8-flops", type=_flops_or_auto, default="auto",
                   help="Fp8Rule.min_fp8_flops for the architectures converted by fp8_model "
                        "(default auto: the recipe's threshold; 0: every GEMM in FP8)")
    p.add_argument("--keep-bf16", default=None, metavar="REGEX",
                   help="for the architectures converted by fp8_model: modules whose path "
                        "matches stay bf16 (a first Fp8Rule(path=REGEX, recipe=None)), e.g. "
                        "lm_head")
    p.add_argument("--gemms-alone", action="store_true",
                   help="also time each FP8 GEMM shape of the step on its own, with both "
                        "accumulations (GPU)")
    p.add_argument("--top-kernels", type=int, default=25,
                   help="kernels with the most device time kept per variant in results.json")
    p.add_argument("--outdir", default=os.path.join("out", "bench_llm"),
                   help="results.json, results.md, plot.png (default out/bench_llm)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def _summary(r):
    parts = [f"process {r['process_s']:.0f} s (init {r['init_s']:.1f}, lower + compile "
             f"{r['lower_compile_s']:.1f}, HLO analysis {r['analysis_s']:.1f}, steps "
             f"{r['steps_s']:.1f}, trace {r['trace_s']:.1f})"]
    parts += common.times_text(r, TIMES)
    if r.get("device_ms") is None:
        parts.append("device time unavailable")
    return parts


def run(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.worker:
        return worker(args)
    # This process starts no jax backend (on a GPU it would hold memory the workers need).
    os.makedirs(args.outdir, exist_ok=True)
    plan = [(SIZES[s], VARIANTS[v]) for s in args.sizes for v in args.variants]
    t_all = time.perf_counter()
    meta = {**common.run_info(__file__, argv),
            "settings": {"sizes": args.sizes, "variants": args.variants, "steps": args.steps,
                         "warmup": args.warmup, "history_len": args.history_len, "lr": args.lr,
                         "seed": args.seed, "attention": args.attention, "scan": args.scan,
                         "fp8_lm_head": args.fp8_lm_head, "rope": not args.no_rope,
                         "min_fp8_flops": args.min_fp8_flops, "keep_bf16": args.keep_bf16,
                         "timeout_per_variant": args.timeout_per_variant,
                         "budget": args.budget},
            "floor_definition": FLOOR_NOTE, "family_definition": FAMILY_NOTE,
            "families": list(FAMILIES)}
    runs = common.Runs(meta, args.outdir, derive, markdown, t_all)
    with common.Progress(len(plan), "bench_llm") as progress:
        progress.log(f"bench_llm: sizes {args.sizes}, variants {args.variants}, "
                     f"{args.steps} steps; one process each")
        for size, v in plan:
            timeout = args.timeout_per_variant
            if args.budget is not None:
                timeout = min(timeout, args.budget - (time.perf_counter() - t_all))
            where = {"size": size.name, "variant": v.name}
            if timeout < 15:
                runs.skipped.append({**where, "reason": "--budget spent"})
                progress.advance(f"{size.name} {v.name}: skipped, --budget spent")
                continue
            progress.status(f"{size.name} {v.name}")
            progress.log(f"{size.name} {v.name}: starting a worker (timeout {timeout:.0f} s)")

            def measure_one(size=size, v=v, timeout=timeout):
                row, errors = run_worker(size, v, args, timeout)
                if not meta.get("environment"):
                    env = row["environment"]
                    meta["environment"] = {k: env.get(k) for k in (
                        "device", "platform", "device_count", "jax_version", "jaxlib_version",
                        "jax_fp8_version", "has_cpu_kernel", "has_cuda_kernel", "xla_flags")}
                    meta["environment"].update(flax_version=flax.__version__,
                                               optax_version=optax.__version__)
                return row, errors
            runs.measure(where, measure_one, _summary, progress)
            save_plot(runs.data(partial=True), args.outdir)
    data = runs.finish()
    save_plot(data, args.outdir)
    common.print_report(data, args.outdir)
    return data


def main(argv=None):
    data = run(argv)
    return data if isinstance(data, int) else (1 if data["failures"] else 0)


if __name__ == "__main__":
    sys.exit(main())
