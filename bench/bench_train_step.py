#!/usr/bin/env python3
"""Benchmark: a whole Flax train step, bf16 vs Flax's FP8 vs jax_fp8, at several model sizes.

The model: N blocks x 4 Dense (d->3d, d->d, d->4d, 4d->d) in a pre-LayerNorm residual
block (the 3d output mixed as a*sigmoid(b)+c, a stand-in for attention), bf16 compute,
float32 parameters, flax.training TrainState + optax.adam, a mean-squared-error loss,
the whole train state donated. Default sizes (d, blocks, tokens = batch x sequence):
1024 x 24 x 1024, 2048 x 24 x 4096 and 4096 x 8 x 8192. Variants (VARIANTS below, one
entry each), every one from the same parameter values and data:

  bf16               plain nn.Dense
  flax_fp8           nn.Dense(dot_general_cls=flax.linen.fp8_ops.Fp8DirectDotGeneralOp),
                     the FP8 variables in Flax's "_overwrite_with_gradient" collection
  jax_fp8            nn.Dense(dot_general_cls=jax_fp8.flax.Fp8DotGeneral) + Fp8TrainState
                     (the FP8 state packed, the default): one jax_fp8_update per step
  jax_fp8_unpacked   the same with Fp8TrainState.create(pack_fp8=False)
  jax_fp8_current, jax_fp8_blockwise   (not run by default) the recipes
                     Float8CurrentScaling() / Float8BlockScaling() passed to the layer
                     and to Fp8TrainState.create; skipped, saying why, where this
                     jax_fp8 does not accept them yet

Per variant and size: the device time per step from a profiler trace (the sum of the
GPU kernel durations / steps; on CPU the XLA op time), the wall time per step of steps
dispatched back to back ("pipelined") and of steps each followed by block_until_ready
("blocked", the median), the compile time, the temporary memory of the compiled step,
the speed-ups vs bf16 and vs Flax FP8, the FP8 GEMM floor (the FP8 GEMM kernels' time:
what the step would take if nothing else ran) and the rest by kernel family, next to
bf16's non-GEMM time; and from the compiled HLO the FP8 GEMMs, custom calls and
jax_fp8_update calls (jax_fp8 variants: exactly one, checked).

The compile time in one process is the later variants' with XLA's autotuning results
of the earlier ones; --compile-fresh compiles each variant again in a fresh process;
--compile-cache DIR does that with JAX's persistent compilation cache and XLA's GPU
autotune cache in DIR/<size>_<variant> (emptied first), then once more in another fresh
process: what the caches save a second run.

Progress goes to stderr, the markdown report to stdout; OUTDIR/results.json and
results.md are rewritten after every variant (an interrupted run keeps what it
measured; the fresh compiles, which all run first, also go to OUTDIR/fresh_compiles.json
one by one), OUTDIR/train_step.png is drawn at the end (needs matplotlib).

Examples:
  python bench/bench_train_step.py                               # 3 sizes x 4 variants
  python bench/bench_train_step.py --sizes 2048x24x4096 --variants bf16,jax_fp8
  python bench/bench_train_step.py --compile-fresh --compile-only  # cold compile times
  python bench/bench_train_step.py --compile-fresh --compile-only --compile-cache /tmp/cc
  python bench/bench_train_step.py --cpu-smoke                    # seconds, on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import fp8_ops as flax_fp8_ops
from flax.training import train_state

import common
import jax_fp8
import xla_log
from jax_fp8.devtools import compilation, hlo, trace
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState

FLAX_OP = getattr(flax_fp8_ops, "Fp8DirectDotGeneralOp", None) or flax_fp8_ops.Fp8DotGeneralOp
FLAX_OWG = getattr(flax_fp8_ops, "OVERWRITE_WITH_GRADIENT", "_overwrite_with_gradient")
UPDATE_TARGET = "jax_fp8_update"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the step. ``kind``: "bf16", "flax" or "jax_fp8"; ``recipe``:
    args -> the jax_fp8 recipe; ``update_calls``: jax_fp8_update calls the compiled step
    must have (None: not checked); ``default``: run without --variants; ``min_fp8_flops``:
    the layers' (GEMMs below it stay bf16)."""

    name: str
    label: str
    kind: str
    recipe: Callable | None = None
    pack_fp8: bool = True
    update_calls: int | None = None
    default: bool = True
    min_fp8_flops: float = 0


def _delayed(args):
    return jax_fp8.DelayedScaling(history_len=args.history_len)


VARIANTS = {v.name: v for v in (
    Variant("bf16", "bf16 (nn.Dense)", "bf16"),
    Variant("flax_fp8", f"Flax FP8 ({FLAX_OP.__name__})", "flax"),
    Variant("jax_fp8", "jax_fp8 (Fp8TrainState, packed)", "jax_fp8", _delayed, update_calls=1),
    Variant("jax_fp8_unpacked", "jax_fp8, pack_fp8=False", "jax_fp8", _delayed,
            pack_fp8=False, update_calls=1),
    # Where delayed scaling stops paying on an H200 (bench_dense.py: 1.02x bf16 at
    # 4096 x 2048 x 2048, a 2**35-FLOP forward GEMM; slower below).
    Variant("jax_fp8_min_flops", "jax_fp8, min_fp8_flops=2**35", "jax_fp8", _delayed,
            update_calls=1, default=False, min_fp8_flops=2.0 ** 35),
    Variant("jax_fp8_current", "jax_fp8, Float8CurrentScaling", "jax_fp8",
            lambda args: jax_fp8.Float8CurrentScaling(), default=False),
    Variant("jax_fp8_blockwise", "jax_fp8, Float8BlockScaling", "jax_fp8",
            lambda args: jax_fp8.Float8BlockScaling(), default=False),
)}
SIZES = {"small": (1024, 24, 1024), "medium": (2048, 24, 4096), "large": (4096, 8, 8192)}
CPU_SMOKE_SIZE = (32, 1, 32)

RecipeNotAccepted = common.RecipeNotAccepted   # a variant that raises it is skipped


# --------------------------------------------------------------------------------------
# The model and the steps.
# --------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LN residual block: Dense d->3d (mixed a*sigmoid(b)+c), d->d, d->4d, 4d->d.

    ``groups`` > 1 takes a, b, c interleaved: the 3d outputs are ``groups`` blocks of
    (a, b, c) slices, so that in3's kernel split on its columns over ``groups`` devices
    gives each device whole slices of a, b and c (no resharding between in3 and out
    under tensor parallelism; bench_multigpu.py). 1: a, b, c are the three thirds."""

    d: int
    dot_general_cls: object = None
    groups: int = 1

    def split3(self, h):
        if self.groups == 1:
            return jnp.split(h, 3, axis=-1)
        lead = h.shape[:-1]
        g = h.reshape(*lead, self.groups, 3, self.d // self.groups)
        return [g[..., i, :].reshape(*lead, self.d) for i in range(3)]

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(nn.Dense, use_bias=False, dtype=jnp.bfloat16,
                                  param_dtype=jnp.float32, dot_general_cls=self.dot_general_cls)
        h = dense(3 * self.d, name="in3")(nn.LayerNorm(dtype=jnp.bfloat16, name="ln1")(x))
        a, b, c = self.split3(h)
        x = x + dense(self.d, name="out")(a * nn.sigmoid(b) + c)
        h = dense(4 * self.d, name="up")(nn.LayerNorm(dtype=jnp.bfloat16, name="ln2")(x))
        return x + dense(self.d, name="down")(nn.gelu(h))


class Model(nn.Module):
    blocks: int
    d: int
    dot_general_cls: object = None
    groups: int = 1

    @nn.compact
    def __call__(self, x):
        for i in range(self.blocks):
            x = Block(self.d, self.dot_general_cls, self.groups, name=f"block{i}")(x)
        return nn.LayerNorm(dtype=jnp.bfloat16, name="ln_f")(x)


def mse(out, y):
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))


def model_for(variant, size, args):
    """The variant's model. ``args.groups`` (Block's; bench_multigpu.py sets it, this
    script's options have none): 1 when absent."""
    d, blocks, _ = size
    groups = getattr(args, "groups", 1)
    if variant.kind == "bf16":
        return Model(blocks, d, groups=groups)
    if variant.kind == "flax":
        return Model(blocks, d, functools.partial(FLAX_OP, amax_history_length=args.history_len),
                     groups)
    return Model(blocks, d, functools.partial(Fp8DotGeneral, recipe=variant.recipe(args),
                                              min_fp8_flops=variant.min_fp8_flops), groups)


_INITS: dict = {}


def _init(variant, size, args, collection):
    """A jitted init returning one variable collection (cached per model and size)."""
    recipe = None if variant.recipe is None else repr(variant.recipe(args))
    key = (variant.kind, recipe, size, args.history_len, getattr(args, "groups", 1), collection)
    if key not in _INITS:
        model = model_for(variant, size, args)
        _INITS[key] = jax.jit(lambda rng, x: model.init(rng, x).get(collection, {}))
    return _INITS[key]


def make_state(variant, size, args, x):
    """A fresh train state; the parameter values are the same for every variant."""
    rng = jax.random.key(args.seed)
    params = _init(VARIANTS["bf16"], size, args, "params")(rng, x)  # bf16's, for all
    model = model_for(variant, size, args)
    tx = optax.adam(args.lr)
    if variant.kind == "bf16":
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    if variant.kind == "flax":
        owg = _init(variant, size, args, FLAX_OWG)(rng, x)
        return train_state.TrainState.create(apply_fn=model.apply, tx=tx,
                                             params={"params": params, FLAX_OWG: owg})
    fp8 = _init(variant, size, args, FP8_COLLECTION)(rng, x)
    return Fp8TrainState.create(apply_fn=model.apply, params=params, fp8=fp8, tx=tx,
                                recipe=variant.recipe(args), pack_fp8=variant.pack_fp8)


def plain_step(state, x, y):
    """bf16, and Flax FP8 (whose "_overwrite_with_gradient" gradients ARE the new FP8
    variables; TrainState.apply_gradients writes them, adam sees only "params")."""
    def loss_fn(variables):
        params = variables if FLAX_OWG in variables else {"params": variables}
        return mse(state.apply_fn(params, x), y)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def jax_fp8_step(state, x, y):
    def loss_fn(params, fp8):
        return mse(state.apply_model(params, fp8, x), y)
    loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params,
                                                                           state.fp8)
    return state.apply_gradients(grads=grads, fp8_grads=fp8_grads), loss


def step_function(variant):
    """The variant's train step: (state, x, y) -> (state, loss)."""
    return jax_fp8_step if variant.kind == "jax_fp8" else plain_step


def lower_step(variant, state, x, y, **jit_kwargs):
    """(lowered, lower_s) of the variant's step, its state donated; ``jit_kwargs`` go to
    jax.jit (e.g. the out_shardings of a sharded step)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        t0 = time.perf_counter()
        lowered = jax.jit(step_function(variant), donate_argnums=(0,),
                          **jit_kwargs).lower(state, x, y)
    return lowered, time.perf_counter() - t0


def compile_step(variant, state, x, y):
    """(compiled, lower_s, compile_s) of the variant's step, its state donated."""
    lowered, lower_s = lower_step(variant, state, x, y)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        t0 = time.perf_counter()
        compiled = lowered.compile()
    return compiled, lower_s, time.perf_counter() - t0


def setup(variant, size, args, x, y, abstract=False):
    """(state, compiled, lower_s, compile_s, init_s). A recipe variant whose recipe this
    jax_fp8 does not take raises RecipeNotAccepted."""
    try:
        t0 = time.perf_counter()
        if abstract:  # shapes only: nothing runs, nothing is allocated
            state = jax.eval_shape(lambda a, b: make_state(variant, size, args, a), x, y)
        else:
            state = jax.block_until_ready(make_state(variant, size, args, x))
        init_s = time.perf_counter() - t0
        return (state, *compile_step(variant, state, x, y), init_s)
    except (TypeError, ValueError, AttributeError, NotImplementedError) as err:
        if variant.recipe is None or variant.recipe is _delayed:
            raise
        raise RecipeNotAccepted(
            f"this jax_fp8 does not take recipe=jax_fp8.{type(variant.recipe(args)).__name__}() "
            f"in Fp8DotGeneral / Fp8TrainState.create yet ({type(err).__name__}: {err})") from err


# --------------------------------------------------------------------------------------
# Measuring.
# --------------------------------------------------------------------------------------

def analyze(mod):
    """What the compiled step (a parsed `hlo.Module`) holds: kernels, GEMMs (FP8 or
    not), custom calls, collectives."""
    gemms = hlo.gemms(mod)
    kernels = hlo.count_kernels(mod)
    return {"kernels": sum(kernels.values()), "fusions": kernels.get("fusion", 0),
            "custom_calls": hlo.custom_calls(mod),
            "fp8_gemms": hlo.fp8_gemms(mod),
            "gemms_fp8": sum(g.fp8 for g in gemms),
            "gemms_other": sum(not g.fp8 for g in gemms),
            "jax_fp8_update": hlo.count_custom_calls(mod, UPDATE_TARGET),
            "collectives": hlo.count_collectives(mod)}


def check_update_calls(variant, r):
    """Records a check_error when the step does not hold the variant's jax_fp8_update calls."""
    found = r["hlo"]["jax_fp8_update"]
    if variant.update_calls is not None and found != variant.update_calls:
        r["check_error"] = (f"expected {variant.update_calls} {UPDATE_TARGET} custom call(s) in "
                            f"the compiled step, found {found} (jax_fp8's kernels loaded: CPU "
                            f"{jax_fp8.HAS_CPU_KERNEL}, CUDA {jax_fp8.HAS_CUDA_KERNEL})")


def gemm_split(families, h):
    """(GEMM ms, FP8 GEMM floor ms or None) from the per-step family times."""
    fp8, other = families.get("fp8 gemm", 0.0), families.get("gemm", 0.0)
    if h["gemms_fp8"] and not h["gemms_other"]:
        return fp8 + other, fp8 + other          # every GEMM of the step is FP8
    if fp8:
        return fp8 + other, fp8                  # the trace named the FP8 ones
    return fp8 + other, None


def measure(variant, size, args, x, y, platform, progress):
    """Measures one variant at one size; returns its result row."""
    d, blocks, tokens = size
    tag = f"{d}x{blocks}x{tokens} {variant.name}"
    r = {"variant": variant.name, "label": variant.label, "d": d, "blocks": blocks,
         "tokens": tokens, "size": size_key(size)}
    progress.status(f"{tag}: init + compile")
    state, compiled, r["lower_s"], r["compile_s"], r["init_s"] = setup(variant, size, args,
                                                                       x, y)
    r["state_arrays"] = len(jax.tree.leaves(state))
    r["memory"] = compilation.memory(compiled)
    r["temp_bytes"] = r["memory"].get("temp_size_in_bytes")
    text = compiled.as_text()
    mod = hlo.parse(text)
    r["hlo"] = analyze(mod)
    ops = hlo.op_families(mod)
    if args.save_hlo:
        with gzip.open(os.path.join(args.outdir, f"hlo_{r['size']}_{variant.name}.txt.gz"),
                       "wt") as fp:
            fp.write(text)
    del text, mod
    check_update_calls(variant, r)
    if args.compile_only:
        del state, compiled
        return r

    def step(s):
        return compiled(s, x, y)  # noqa: F821 (bound above; deleted only on an earlier return)

    progress.status(f"{tag}: timing")
    state, times, losses = common.time_steps(step, state, args)
    r.update(times)
    if args.trace_steps:
        progress.status(f"{tag}: tracing")
        n = args.trace_steps
        state, events = trace.capture(lambda s: step(s)[0], state, steps=n)
        dev = trace.device_events(events)
        if dev:
            r["device_ms"] = trace.total_us(dev) / n / 1e3
            r["events_per_step"] = len(dev) / n
            fam = {k: v / n / 1e3 for k, v in trace.by_family(dev, ops).items()}
            r["families_ms"] = {k: round(v, 5) for k, v in fam.items()}
            r["gemm_ms"], r["fp8_gemm_floor_ms"] = gemm_split(fam, r["hlo"])
            r["non_gemm_ms"] = r["device_ms"] - r["gemm_ms"]
            top = list(trace.by_name(dev).items())[:args.top_kernels]
            r["top_kernels"] = [{"name": k[:160], "per_step": c / n, "ms_per_step": us / n / 1e3}
                                for k, (c, us) in top]
        else:
            r["trace_error"] = "no device events in the trace"
    r["loss_first"], r["loss_last"] = losses[0], losses[-1]
    r["loss_finite"] = all(math.isfinite(v) for v in losses)
    del state, compiled
    return r


def fresh_row(variant, size, fresh):
    """The result row of a variant compiled only in a fresh process (--compile-only
    --compile-fresh)."""
    if "skip" in fresh:
        raise RecipeNotAccepted(fresh["skip"])
    if "error" in fresh:
        raise RuntimeError(fresh["error"])
    d, blocks, tokens = size
    memory = fresh["memory"]
    r = {"variant": variant.name, "label": variant.label, "d": d, "blocks": blocks,
         "tokens": tokens, "size": size_key(size), "hlo": fresh["hlo"], "memory": memory,
         "temp_bytes": memory.get("temp_size_in_bytes"), "compile_s": None,
         "state_arrays": fresh.get("state_arrays")}
    check_update_calls(variant, r)
    return r


def fresh_compile(variant, size, args, cache_dir=None, log_passes=False):
    """Compiles the variant's step in a fresh Python process; returns that process's
    result dict. Without ``cache_dir`` no autotuning results or compilation cache of
    other compiles reach it; with it, JAX's persistent compilation cache (every compile
    kept) lives there, and with it XLA's GPU autotune cache, which JAX's cache turns on in
    DIR/xla_gpu_per_fusion_autotune_cache_dir (``jax_persistent_cache_enable_xla_caches``).
    ``log_passes``: the process logs XLA's pass timers, kept in
    OUTDIR/compile_log_<size>_<variant>.txt.gz with XLA:GPU's autotuning log
    (autotune_log_<size>_<variant>.txt: every candidate's run time), and the result gets
    "passes", "pass_s", "autotune" and "candidate_checks" (`xla_log.summary`)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               JAX_ENABLE_COMPILATION_CACHE="false")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cached = re.compile(r"--xla_gpu_(per_fusion_autotune_cache_dir|load_autotune_results_from)")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not cached.match(f)]
    if cache_dir is not None:
        env.update(JAX_ENABLE_COMPILATION_CACHE="true", JAX_COMPILATION_CACHE_DIR=cache_dir,
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                   JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=AUTOTUNE_CACHE)
    tag = f"{size_key(size)}_{variant.name}"
    if log_passes:
        env.update(xla_log.LOG_ENV)
        flags.append("--xla_gpu_dump_autotune_logs_to="
                     + os.path.join(os.path.abspath(args.outdir), f"autotune_log_{tag}.txt"))
    env["XLA_FLAGS"] = " ".join(flags)
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, os.path.abspath(__file__), "--child-compile", "--sizes",
           size_key(size), "--variants", variant.name, "--history-len", str(args.history_len)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPILE_RESULT ")]
    if log_passes:
        with gzip.open(os.path.join(args.outdir, f"compile_log_{tag}.txt.gz"), "wt") as fp:
            fp.write(proc.stderr)
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"fresh compile exited {proc.returncode}: {proc.stderr[-1500:]}")
    out = json.loads(lines[-1][len("COMPILE_RESULT "):])
    if log_passes and "compile_s" in out:
        out.update(xla_log.summary(proc.stderr))
    return out


AUTOTUNE_CACHE = "xla_gpu_per_fusion_autotune_cache_dir"  # (JAX's name for it, and its folder)


def autotuned_fusions(cache_dir) -> int:
    """The fusions XLA:GPU autotuned into a cache folder: one file each (0 elsewhere)."""
    return sum(len(files) for _, _, files in os.walk(os.path.join(cache_dir, AUTOTUNE_CACHE)))


def cold_and_cached_compile(variant, size, args):
    """fresh_compile's result; with --compile-cache also "cached_compile_s", the compile
    time of a second fresh process that finds the first one's caches, and
    "autotuned_fusions", what the first one's autotuning left in the cache."""
    if args.compile_cache is None:
        return fresh_compile(variant, size, args, log_passes=args.compile_passes)
    cache_dir = os.path.join(os.path.abspath(args.compile_cache),
                             f"{size_key(size)}_{variant.name}")
    shutil.rmtree(cache_dir, ignore_errors=True)
    out = fresh_compile(variant, size, args, cache_dir, log_passes=args.compile_passes)
    if "compile_s" in out:
        out["autotuned_fusions"] = autotuned_fusions(cache_dir)
        out["cached_compile_s"] = fresh_compile(variant, size, args, cache_dir)["compile_s"]
    return out


def child_compile(args):
    """--child-compile: lower and compile from shapes only, print one JSON line."""
    (size,), (name,) = args.sizes, args.variants
    d, _, tokens = size
    x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
    try:
        state, compiled, lower_s, compile_s, _ = setup(VARIANTS[name], size, args, x, x,
                                                       abstract=True)
        out = {"lower_s": lower_s, "compile_s": compile_s, "hlo": analyze(hlo.parse(compiled)),
               "memory": compilation.memory(compiled), "state_arrays": len(jax.tree.leaves(state))}
    except RecipeNotAccepted as err:
        out = {"skip": str(err)}
    print("COMPILE_RESULT " + json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------------------
# Derived numbers and the report.
# --------------------------------------------------------------------------------------

TIMES = (("device_ms", "device"), ("pipelined_ms", "pipelined"), ("blocked_ms", "blocked"))


def size_key(size):
    return "x".join(str(v) for v in size)


def derive(results):
    """Per size: each variant's speed-ups vs bf16 and vs Flax FP8 for every time, its
    device time over its FP8 GEMM floor, and its non-GEMM time minus bf16's."""
    out = {}
    for key, rows in common.by_group(results, "size").items():
        per = common.speedups(rows, [metric for metric, _ in TIMES])
        base = rows.get("bf16", {})
        for v, r in rows.items():
            e = per[v]
            if r.get("device_ms") and r.get("fp8_gemm_floor_ms"):
                e["device_over_floor"] = r["device_ms"] / r["fp8_gemm_floor_ms"]
            if r.get("non_gemm_ms") is not None and base.get("non_gemm_ms") is not None:
                e["non_gemm_minus_bf16_ms"] = r["non_gemm_ms"] - base["non_gemm_ms"]
        out[key] = per
    return out


def _families_table(rows, top=10):
    """Non-GEMM ms per step by kernel family, one column per variant."""
    fams = {}
    for r in rows:
        for k, v in (r.get("families_ms") or {}).items():
            if k not in ("gemm", "fp8 gemm"):
                fams[k] = max(fams.get(k, 0.0), v)
    if not fams:
        return []
    shown = sorted(fams, key=lambda k: -fams[k])[:top]
    lines = ["| non-GEMM kernels, ms/step | " + " | ".join(r["variant"] for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for k in shown:
        lines.append(f"| {k} | " + " | ".join(common.fmt((r.get("families_ms") or {}).get(k),
                                                          "{:.3f}", "0") for r in rows) + " |")
    rest = [sum(v for k, v in (r.get("families_ms") or {}).items()
                if k not in shown and k not in ("gemm", "fp8 gemm")) for r in rows]
    if any(rest):
        lines.append("| (other families) | " + " | ".join(f"{v:.3f}" for v in rest) + " |")
    lines.append("| **non-GEMM total** | " + " | ".join(
        common.fmt(r.get("non_gemm_ms"), "**{:.3f}**") for r in rows) + " |")
    return lines


def _compile_passes_table(rows, top=3):
    """Where each fresh compile's time went (--compile-passes), one row per variant."""
    rows = [r for r in rows if r.get("compile_passes")]
    if not rows:
        return []
    lines = ["Fresh compile by XLA's pass timers (s): all HLO passes; XLA:GPU's autotuning "
             "pass, split into its candidates' compilation and what follows it (their runs "
             "on the device); the fusions it tuned; the candidates whose output disagreed "
             "with the winners' (and their elements outside the tolerance, in millions); "
             "the slowest other passes.", "",
             "| variant | fresh compile | HLO passes | autotuning | candidates' compilation | "
             "after it | fusions tuned | disagreeing candidates | slowest other passes |",
             "|---|" + "---:|" * 7 + "---|"]
    for r in rows:
        a = r.get("compile_autotune") or {}
        c = r.get("compile_candidate_checks")
        checks = "" if c is None else \
            f"{c['disagreeing']} of {sum(c['candidates'].values())} " \
            f"({c['disagreeing_elements'] / 1e6:.0f} M)"
        others = [(k, s) for k, s in r["compile_passes"] if not xla_log.is_autotuning(k)][:top]
        lines.append("| " + " | ".join([
            r["label"], common.fmt(r.get("compile_fresh_s"), "{:.1f}"),
            common.fmt(r.get("compile_pass_s"), "{:.1f}"), common.fmt(a.get("s"), "{:.1f}"),
            common.fmt(a.get("compile_s"), "{:.1f}"), common.fmt(a.get("after_s"), "{:.1f}"),
            common.fmt(a.get("fusions"), "{:d}"), checks,
            ", ".join(f"{k} {s:.2f}" for k, s in others)]) + " |")
    return lines


def markdown(data):
    meta, s = data["meta"], data["meta"]["settings"]
    gib = 2.0 ** 30
    lines = [f"# Train step: bf16 vs Flax FP8 vs jax_fp8 — {meta['device']}", "",
             f"N blocks x 4 Dense (d->3d, d->d, d->4d, 4d->d), bf16 compute, f32 params, "
             f"TrainState + optax.adam, state donated, amax history {s['history_len']}; "
             f"{s['warmup']} warm-up steps, {s['steps']} timed, {s['trace_steps']} traced. "
             f"jax {meta['jax_version']}, flax {meta['flax_version']}, optax "
             f"{meta['optax_version']}, jax_fp8 {meta['jax_fp8_version']}; git "
             f"{meta['git_commit']}; {meta['date']}.", "",
             "device: sum of the device's kernel durations per step (profiler trace; on CPU "
             "the XLA op time); pipelined: wall time per step, steps dispatched back to back; "
             "blocked: median wall time of steps each followed by block_until_ready; × > 1 is "
             "faster; compile: in this process (later variants reuse earlier autotuning), "
             "fresh: in a new process; cached: in a second new process that finds the first "
             "one's compilation and autotune caches (--compile-cache; autotuned: the fusions "
             "XLA:GPU autotuned into that cache); temp: the compiled "
             "step's temporary buffers; FP8 GEMM "
             "floor: the FP8 GEMM kernels' time per step."]
    for key, per in data["derived"].items():
        rows = [r for r in data["results"] if r["size"] == key]
        d, blocks, tokens = key.split("x")
        lines += ["", f"## d = {d}, {blocks} blocks, {tokens} tokens", "",
                  "| variant | device ms | × bf16 | × Flax FP8 | pipelined ms | × bf16 | "
                  "× Flax FP8 | blocked ms | compile s | fresh compile s | cached compile s | "
                  "autotuned | temp GiB |", "|---|" + "---:|" * 12]
        for r in rows:
            e = per.get(r["variant"], {})
            cells = [r["label"]]
            for metric in ("device_ms", "pipelined_ms"):
                cells += [common.fmt(r.get(metric), "{:.3f}"),
                          common.fmt(e.get(f"{metric}:vs_bf16"), "{:.3f}"),
                          common.fmt(e.get(f"{metric}:vs_flax"), "{:.3f}")]
            temp = r.get("temp_bytes")
            cells += [common.fmt(r.get("blocked_ms"), "{:.3f}"),
                      common.fmt(r.get("compile_s"), "{:.1f}"),
                      common.fmt(r.get("compile_fresh_s"), "{:.1f}"),
                      common.fmt(r.get("compile_cached_s"), "{:.1f}"),
                      common.fmt(r.get("autotuned_fusions"), "{:d}"),
                      common.fmt(None if temp is None else temp / gib)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "| variant | GEMM ms | FP8 GEMM floor ms | device / floor | non-GEMM ms | "
                  "non-GEMM − bf16's ms | FP8 GEMMs (HLO) | other GEMMs | `jax_fp8_update` | "
                  "kernels | state arrays |", "|---|" + "---:|" * 10]
        for r in rows:
            e, h = per.get(r["variant"], {}), r["hlo"]
            fp8 = ", ".join(f"{n} `{k}`" for k, n in h["fp8_gemms"].items()) or "0"
            lines.append("| " + " | ".join([
                r["label"], common.fmt(r.get("gemm_ms"), "{:.3f}"),
                common.fmt(r.get("fp8_gemm_floor_ms"), "{:.3f}"),
                common.fmt(e.get("device_over_floor"), "{:.3f}"),
                common.fmt(r.get("non_gemm_ms"), "{:.3f}"),
                common.fmt(e.get("non_gemm_minus_bf16_ms"), "{:+.3f}"), fp8,
                str(h["gemms_other"]), str(h["jax_fp8_update"]), str(h["kernels"]),
                str(r.get("state_arrays", "—"))]) + " |")
        fam = _families_table(rows)
        if fam:
            lines += [""] + fam
        passes = _compile_passes_table(rows)
        if passes:
            lines += [""] + passes
        for r in rows:
            if r.get("check_error"):
                lines.append(f"\nCHECK FAILED {key} {r['variant']}: {r['check_error']}")
    lines += common.skipped_and_failed(data, "size")
    lines += ["", common.command_line(meta)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------

def _sizes(text):
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item in SIZES:
            out.append(SIZES[item])
        elif re.fullmatch(r"\d+x\d+x\d+", item):
            out.append(tuple(int(v) for v in item.split("x")))
        elif item:
            raise argparse.ArgumentTypeError(
                f"a size is DxBLOCKSxTOKENS (e.g. 2048x24x4096) or one of {', '.join(SIZES)}; "
                f"got {item!r}")
    if not out:
        raise argparse.ArgumentTypeError("no sizes given")
    return out


def build_parser():
    p = common.arg_parser("A whole Flax train step: bf16, Flax FP8 and jax_fp8 side by side, "
                          "at several model sizes (bench/README.md).", __doc__)
    p.add_argument("--sizes", type=_sizes, default=list(SIZES.values()), metavar="DxBxT,...",
                   help="model width x blocks x tokens, or small/medium/large (default: "
                        + ",".join(size_key(s) for s in SIZES.values()) + ")")
    p.add_argument("--variants", type=common.subset_of(VARIANTS, "variants"),
                   default=[k for k, v in VARIANTS.items() if v.default],
                   help="comma-separated subset of " + ",".join(VARIANTS) + ", or all "
                        "(default: " + ",".join(k for k, v in VARIANTS.items() if v.default) + ")")
    p.add_argument("--steps", type=int, default=10, help="timed steps, blocked and pipelined (10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (3)")
    p.add_argument("--trace-steps", type=int, default=5,
                   help="steps in the profiler trace (5; 0: none)")
    p.add_argument("--history-len", type=int, default=1024,
                   help="amax history length, Flax and jax_fp8 alike (1024, both defaults)")
    p.add_argument("--lr", type=float, default=1e-4, help="adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-fresh", action="store_true",
                   help="also compile every variant in a fresh process (cold compile time)")
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="with --compile-fresh: the fresh compile with JAX's compilation cache "
                        "and XLA's autotune cache in DIR/<size>_<variant> (emptied first), "
                        "then a second fresh process that finds them (cached compile time)")
    p.add_argument("--compile-passes", action="store_true",
                   help="with --compile-fresh: the fresh (cold) compile logs XLA's pass "
                        "timers; reported: its slowest passes, and XLA:GPU's autotuning split "
                        "into its candidates' compilation and their runs (logs kept in OUTDIR)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile and inspect the steps, run none")
    p.add_argument("--cpu-smoke", action="store_true",
                   help=f"on CPU, size {size_key(CPU_SMOKE_SIZE)}, 2 steps: a check that "
                        "everything runs, in seconds")
    p.add_argument("--top-kernels", type=int, default=30,
                   help="kernels with the most device time kept per variant in results.json")
    p.add_argument("--save-hlo", action="store_true",
                   help="write each compiled step to OUTDIR/hlo_<size>_<variant>.txt.gz")
    p.add_argument("--outdir", default=os.path.join("out", "bench_train_step"),
                   help="results.json, results.md, train_step.png (default out/bench_train_step)")
    p.add_argument("--child-timeout", type=float, default=900, help=argparse.SUPPRESS)
    p.add_argument("--child-compile", action="store_true",
                   help="compile the step of one size and variant from shapes in this process "
                        "and print the result as one JSON line (what --compile-fresh runs in "
                        "each new process; with XLA_FLAGS, e.g. to inspect XLA's autotuning)")
    return p


def _finalize(args, argv):
    if args.cpu_smoke:  # before any backend starts: CPU, and XLA's quickest compiles
        jax.config.update("jax_platforms", "cpu")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_backend_optimization_level=0").strip()
        if "--sizes" not in argv:
            args.sizes = [CPU_SMOKE_SIZE]
        for name, value in (("steps", 2), ("warmup", 1), ("trace_steps", 2)):
            if f"--{name.replace('_', '-')}" not in argv:
                setattr(args, name, value)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    for flag, value in (("--compile-cache", args.compile_cache is not None),
                        ("--compile-passes", args.compile_passes)):
        if value and not args.compile_fresh:
            raise SystemExit(f"{flag} needs --compile-fresh")
    args.warmup, args.trace_steps = max(0, args.warmup), max(0, args.trace_steps)
    return args


def measure_variant(variant, size, args, x, y, platform, progress, fresh):
    """(result row, check errors) of one variant at one size, its fresh compile's (``fresh``,
    {} without --compile-fresh) times in the row: measured here, or with --compile-only
    --compile-fresh the fresh compile alone."""
    if args.compile_only and args.compile_fresh:  # the fresh compile is all
        r = fresh_row(variant, size, fresh)
    else:
        r = measure(variant, size, args, x, y, platform, progress)
    r.update({f"{k}_fresh_s": fresh[f"{k}_s"] for k in ("lower", "compile") if f"{k}_s" in fresh})
    if "cached_compile_s" in fresh:
        r["compile_cached_s"] = fresh["cached_compile_s"]
        r["autotuned_fusions"] = fresh.get("autotuned_fusions")
    for key in ("passes", "pass_s", "autotune", "candidate_checks"):
        if key in fresh:
            r[f"compile_{key}"] = fresh[key]
    errors = []
    if "error" in fresh:  # (the in-process measurement went on)
        r["compile_fresh_error"] = fresh["error"]
        errors.append(f"fresh compile: {fresh['error']}")
    if r.get("check_error"):
        errors.append(r["check_error"])
    return r, errors


def run(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _finalize(build_parser().parse_args(argv), argv)
    if args.child_compile:
        return child_compile(args)
    os.makedirs(args.outdir, exist_ok=True)
    variants = [VARIANTS[v] for v in args.variants]
    plan = [(size, v) for size in args.sizes for v in variants]
    fresh = {}
    t_all = time.perf_counter()
    with common.Progress(len(plan) * (1 + args.compile_fresh), "train step") as progress:
        if args.compile_fresh:  # before this process takes the device's memory
            for size, v in plan:
                progress.status(f"{size_key(size)} {v.name}: fresh compile")
                try:
                    fresh[(size, v.name)] = cold_and_cached_compile(v, size, args)
                except Exception as err:  # noqa: BLE001
                    fresh[(size, v.name)] = {"error": f"{type(err).__name__}: {err}"}
                out = fresh[(size, v.name)]
                # Kept as they come (a run cut short keeps them; results.json is written
                # once this process may start the backend, after every fresh compile).
                with open(os.path.join(args.outdir, "fresh_compiles.json"), "w") as f:
                    json.dump({f"{size_key(sz)} {name}": r for (sz, name), r in fresh.items()},
                              f, indent=1)
                progress.advance(f"{size_key(size)} {v.name}: fresh compile " + (
                    f"{out['compile_s']:.1f} s" if "compile_s" in out else
                    f"skipped: {out['skip']}" if "skip" in out else f"FAILED: {out['error']}")
                    + (f", cached {out['cached_compile_s']:.1f} s, "
                       f"{out['autotuned_fusions']} fusions autotuned"
                       if "cached_compile_s" in out else "")
                    + (f", autotuning {out['autotune']['s']:.1f} s (candidates' compilation "
                       f"{out['autotune']['compile_s']:.1f} s)" if out.get("autotune") else ""))
        platform = common.platform_name()
        meta = common.environment(__file__, argv)
        meta.update(flax_version=flax.__version__, optax_version=optax.__version__,
                    settings={"sizes": [size_key(s) for s in args.sizes],
                              "variants": args.variants, "steps": args.steps,
                              "warmup": args.warmup, "trace_steps": args.trace_steps,
                              "history_len": args.history_len, "lr": args.lr,
                              "compile_fresh": args.compile_fresh,
                              "compile_cache": args.compile_cache is not None,
                              "compile_passes": args.compile_passes,
                              "compile_only": args.compile_only})
        runs = common.Runs(meta, args.outdir, derive, markdown, t_all)
        progress.log(f"train step: {meta['device']} ({platform}), jax {meta['jax_version']}, "
                     f"sizes {meta['settings']['sizes']}, variants {args.variants}")
        if platform == "gpu" and not jax_fp8.HAS_CUDA_KERNEL:
            progress.log("WARNING: jax_fp8's CUDA kernel is not loaded: the jax_fp8 variants "
                         "run the jax.numpy fallback")
        current = None
        for size, v in plan:
            if size != current:  # new data; the previous size's init functions dropped
                current = size
                _INITS.clear()
                rng = np.random.default_rng(args.seed)
                d, _, tokens = size
                x, y = (jnp.asarray(rng.standard_normal((tokens, d), np.float32), jnp.bfloat16)
                        for _ in range(2))
            runs.measure({"size": size_key(size), "variant": v.name},
                         functools.partial(measure_variant, v, size, args, x, y, platform,
                                           progress, fresh.get((size, v.name), {})),
                         _summary, progress)
    data = runs.finish()
    if data["results"] and not args.compile_only:
        common.save_plot("plot_train_step", data, os.path.join(args.outdir, "train_step.png"),
                         lambda m: print(m, file=sys.stderr))
    common.print_report(data, args.outdir)
    return data


def _summary(r):
    """The progress line's phrases for one result row."""
    parts = [f"init {r['init_s']:.1f} s, compile {r['compile_s']:.1f} s"
             if r.get("compile_s") is not None else
             f"fresh compile {r.get('compile_fresh_s', 0):.1f} s"]
    parts += common.times_text(r, TIMES)
    if r.get("fp8_gemm_floor_ms") is not None:
        parts.append(f"FP8 GEMM floor {r['fp8_gemm_floor_ms']:.3f} ms")
    if r.get("check_error"):
        parts.append(f"CHECK FAILED: {r['check_error']}")
    return parts


def main(argv=None):
    data = run(argv)
    return data if isinstance(data, int) else (1 if data["failures"] else 0)


if __name__ == "__main__":
    sys.exit(main())
