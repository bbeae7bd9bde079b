#!/usr/bin/env python3
"""Benchmark: a whole Flax train step, bf16 vs Flax's FP8 vs jax_fp8 (with and without
their per-step FP8 bookkeeping).

The model is MEASURING.md's: N blocks x 4 Dense (d->3d, d->d, d->4d, 4d->d) in a
pre-LayerNorm residual block (the 3d output is mixed as a*sigmoid(b)+c, a stand-in
for attention), d = 2048, 4096 tokens (batch x seq flattened), bf16 compute with
float32 parameters, a flax.training TrainState + optax.adam, a mean-squared-error
loss. Variants (each a jitted train step with the whole train state donated):

  bf16               plain nn.Dense
  flax_fp8           nn.Dense(dot_general_cls=Fp8DirectDotGeneralOp) (Fp8DotGeneralOp
                     on a Flax without it), the FP8 variables in Flax's
                     "_overwrite_with_gradient" collection, handled the usual Flax way:
                     TrainState(params={"params": ..., "_overwrite_with_gradient": ...}),
                     whose apply_gradients overwrites that collection with its gradient
  flax_fp8_noupdate  the same with flax.linen.fp8_ops.update_fp8_meta patched (for
                     this variant's trace only) to return the old scale and history:
                     no amax, no history roll, no scale computation
  jax_fp8            nn.Dense(dot_general_cls=jax_fp8.flax.Fp8DotGeneral) and
                     Fp8TrainState: ONE jax_fp8.update_states call per step (asserted:
                     exactly one jax_fp8_update custom call in the compiled HLO)
  jax_fp8_noupdate   the same with the FP8 state returned unchanged (asserted: no
                     jax_fp8_update custom call)
  jax_fp8_packed     jax_fp8 with Fp8TrainState(pack_fp8=True): the FP8 state as one
                     stacked state per (FP8 dtype, history length), fewer step arguments
  jax_fp8_packed_noupdate  its twin, the packed FP8 state returned unchanged

For each: compile time; the median wall time of --steps steps after --warmup steps,
each followed by block_until_ready ("wall, median"); the wall time per step of --steps
steps dispatched back to back ("wall, pipelined"); the host time until the call returns
("dispatch"); on a GPU the device time per step from a profiler trace (the sum of the
GPU kernel durations, as MEASURING.md describes; with --trace-steps on CPU the XLA op
time); the speed-up vs bf16; the bookkeeping (variant - its no-update twin) in ms and %
of the step; and from the compiled HLO: kernel-level instructions, fusions, custom
calls by target (e.g. __cublas$lt$matmul$f8), FP8 GEMM fusions (fusions whose body has
a dot with f8 operands, e.g. Triton GEMMs) and jax_fp8_update custom calls. The
issue's targets (at d = 2048, 4096 tokens): jax_fp8 bookkeeping <= 1 % of its step,
jax_fp8 >= 1.15x faster than bf16 and >= 1.08x faster than Flax FP8, each evaluated on
every time measured (MET / NOT MET).

Progress goes to stderr, the markdown report to stdout; --outdir DIR writes
DIR/results.json (rewritten after every variant, so an interrupted run keeps what it
measured) and DIR/results.md.

Examples:
  python bench/bench_train_step.py --outdir out/train_step                  # 24 x 2048, 4096 tokens
  python bench/bench_train_step.py --small                                  # d=1024, 1024 tokens
  python bench/bench_train_step.py --sizes 2048x4096,1024x1024 --time-limit 220
  python bench/bench_train_step.py --blocks 2 --d 64 --tokens 64 --steps 2 # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
import warnings

import numpy as np

import jax
import jax.numpy as jnp

import flax
import flax.linen as nn
import optax
from flax.linen import fp8_ops as flax_fp8_ops
from flax.training import train_state

import jax_fp8
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_update  # noqa: E402  (HLO parsing, profiler traces)

VARIANTS = ("bf16", "flax_fp8", "flax_fp8_noupdate", "jax_fp8", "jax_fp8_noupdate",
            "jax_fp8_packed", "jax_fp8_packed_noupdate")
# Run order: what the targets need first (a --time-limit skips from the end).
RUN_ORDER = ("bf16", "jax_fp8", "jax_fp8_noupdate", "flax_fp8", "flax_fp8_noupdate",
             "jax_fp8_packed", "jax_fp8_packed_noupdate")
TWIN = {"flax_fp8": "flax_fp8_noupdate", "jax_fp8": "jax_fp8_noupdate",
        "jax_fp8_packed": "jax_fp8_packed_noupdate"}
LABELS = {
    "bf16": "bf16 (nn.Dense)",
    "flax_fp8": "Flax FP8",
    "flax_fp8_noupdate": "Flax FP8, update_fp8_meta patched out",
    "jax_fp8": "jax_fp8 (Fp8DotGeneral + Fp8TrainState)",
    "jax_fp8_noupdate": "jax_fp8, FP8 state not updated",
    "jax_fp8_packed": "jax_fp8, FP8 state packed (Fp8TrainState(pack_fp8=True))",
    "jax_fp8_packed_noupdate": "jax_fp8, FP8 state packed, not updated",
}
TARGET_SIZE = (2048, 4096)
TARGETS = (  # (key, description, threshold)
    ("bookkeeping", "jax_fp8 bookkeeping <= 1 % of its step", 0.01),
    ("vs_bf16", "jax_fp8 >= 1.15x faster than bf16", 1.15),
    ("vs_flax", "jax_fp8 >= 1.08x faster than Flax FP8", 1.08),
)
UPDATE_TARGET = "jax_fp8_update"
CUBLAS_F8 = "__cublas$lt$matmul$f8"
FLAX_OWG = getattr(flax_fp8_ops, "OVERWRITE_WITH_GRADIENT", "_overwrite_with_gradient")
FLAX_OP = getattr(flax_fp8_ops, "Fp8DirectDotGeneralOp", None) or flax_fp8_ops.Fp8DotGeneralOp


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LN residual block: Dense d->3d (mixed a*sigmoid(b)+c), d->d, d->4d, 4d->d."""

    d: int
    dot_general_cls: object = None
    dtype: object = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(nn.Dense, use_bias=False, dtype=self.dtype,
                                  param_dtype=jnp.float32,
                                  dot_general_cls=self.dot_general_cls)
        h = dense(3 * self.d, name="in3")(nn.LayerNorm(dtype=self.dtype, name="ln1")(x))
        a, b, c = jnp.split(h, 3, axis=-1)
        x = x + dense(self.d, name="out")(a * nn.sigmoid(b) + c)
        h = dense(4 * self.d, name="up")(nn.LayerNorm(dtype=self.dtype, name="ln2")(x))
        return x + dense(self.d, name="down")(nn.gelu(h))


class Model(nn.Module):
    blocks: int
    d: int
    dot_general_cls: object = None
    dtype: object = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        for i in range(self.blocks):
            x = Block(self.d, self.dot_general_cls, self.dtype, name=f"block{i}")(x)
        return nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)


def mse(out, y):
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))


def model_for(variant, args):
    if variant == "bf16":
        dg = None
    elif variant.startswith("flax_fp8"):
        dg = functools.partial(FLAX_OP, amax_history_length=args.history_len)
    else:
        dg = functools.partial(Fp8DotGeneral, recipe=recipe_for(args))
    return Model(args.blocks, args.d, dg)


def recipe_for(args):
    return jax_fp8.DelayedScaling(history_len=args.history_len)


# --------------------------------------------------------------------------------------
# Train states and steps.
# --------------------------------------------------------------------------------------

_INIT_CACHE = {}


def _init_fn(kind, args, what):
    """A jitted init returning one collection of `kind`'s variables (cached per size)."""
    key = (kind, what, args.blocks, args.d, args.tokens, args.history_len)
    if key not in _INIT_CACHE:
        model = model_for(kind, args)
        _INIT_CACHE[key] = jax.jit(lambda rng, x: model.init(rng, x)[what])
    return _INIT_CACHE[key]


def make_state(variant, args, x):
    """A fresh train state (same parameter values for every variant: same rng, same paths)."""
    rng = jax.random.key(args.seed)
    params = _init_fn("bf16", args, "params")(rng, x)
    model = model_for(variant, args)
    tx = optax.adam(args.lr)
    if variant == "bf16":
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    if variant.startswith("flax_fp8"):
        owg = _init_fn("flax_fp8", args, FLAX_OWG)(rng, x)
        return train_state.TrainState.create(apply_fn=model.apply, tx=tx,
                                             params={"params": params, FLAX_OWG: owg})
    fp8 = _init_fn("jax_fp8", args, FP8_COLLECTION)(rng, x)
    return Fp8TrainState.create(apply_fn=model.apply, params=params, fp8=fp8, tx=tx,
                                recipe=recipe_for(args),
                                pack_fp8=variant.startswith("jax_fp8_packed"))


def bf16_step(state, x, y):
    def loss_fn(params):
        return mse(state.apply_fn({"params": params}, x), y)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def flax_fp8_step(state, x, y):
    # Flax's usual FP8 train step: the gradient of the "_overwrite_with_gradient"
    # collection IS its new value (fp8_ops' custom_vjps return the updated scale and
    # history as "gradients"); TrainState.apply_gradients overwrites it, adam sees
    # only "params".
    def loss_fn(variables):
        return mse(state.apply_fn(variables, x), y)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _jax_fp8_step(state, x, y, update):
    def loss_fn(params, fp8):
        return mse(state.apply_model(params, fp8, x), y)
    loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params,
                                                                           state.fp8)
    # update=False: the FP8 state is returned unchanged (XLA then drops the amaxes too).
    return state.apply_gradients(grads=grads, fp8_grads=fp8_grads if update else None), loss


STEPS = {
    "bf16": bf16_step,
    "flax_fp8": flax_fp8_step,
    "flax_fp8_noupdate": flax_fp8_step,
    "jax_fp8": functools.partial(_jax_fp8_step, update=True),
    "jax_fp8_noupdate": functools.partial(_jax_fp8_step, update=False),
    "jax_fp8_packed": functools.partial(_jax_fp8_step, update=True),
    "jax_fp8_packed_noupdate": functools.partial(_jax_fp8_step, update=False),
}


@contextlib.contextmanager
def flax_fp8_meta_frozen():
    """Patches Flax's per-tensor FP8 bookkeeping to return the old scale and history.

    flax.linen.fp8_ops.update_fp8_meta(x, q_dtype, scale, amax_history) computes the
    new scale from max(history) and rolls amax(x) into the history; every FP8 op of
    fp8_ops (in_q, quantized_dot's backward, quantize_dequantize_update) looks it up as
    a module global at trace time. A Flax without it: compute_scale and
    compute_amax_history instead. Restored on exit.
    """
    saved = {}
    if hasattr(flax_fp8_ops, "update_fp8_meta"):
        patches = {"update_fp8_meta":
                   lambda x, q_dtype, scale, amax_history, *a, **k: (scale, amax_history)}
    else:
        patches = {"compute_scale": lambda amax, scale, *a, **k: scale,
                   "compute_amax_history": lambda x, amax_history, *a, **k: amax_history}
    missing = [n for n in patches if not hasattr(flax_fp8_ops, n)]
    if missing:
        raise RuntimeError(f"flax.linen.fp8_ops has no {missing}: cannot patch out Flax's "
                           "FP8 bookkeeping in this Flax version")
    try:
        for name, fn in patches.items():
            saved[name] = getattr(flax_fp8_ops, name)
            setattr(flax_fp8_ops, name, fn)
        yield sorted(patches)
    finally:
        for name, fn in saved.items():
            setattr(flax_fp8_ops, name, fn)


def compile_step(variant, state, x, y):
    """Lowers and compiles `variant`'s step (state donated); returns (compiled, info)."""
    # A fresh function object per compile, so no trace cache crosses the patch boundary.
    fn = functools.wraps(STEPS[variant])(lambda s, a, b: STEPS[variant](s, a, b))
    info = {}
    ctx = flax_fp8_meta_frozen() if variant == "flax_fp8_noupdate" else \
        contextlib.nullcontext(None)
    with ctx as patched, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        t0 = time.perf_counter()
        lowered = jax.jit(fn, donate_argnums=(0,)).lower(state, x, y)
        info["lower_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        info["compile_s"] = time.perf_counter() - t0
    if patched:
        info["patched"] = [f"flax.linen.fp8_ops.{n}" for n in patched]
    return compiled, info


# --------------------------------------------------------------------------------------
# The compiled HLO.
# --------------------------------------------------------------------------------------

_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_BACKEND_KIND_RE = re.compile(r'"kind"\s*:\s*"([^"]+)"')
_FUSION_KIND_RE = re.compile(r"\bkind=(k\w+)")
_DOT_OPCODES = ("dot", "scaled-dot", "ragged-dot")


def _operands(line, opcode):
    """The operand texts of `opcode(...)` in an instruction line."""
    start = line.find(opcode + "(", line.find("="))
    if start < 0:
        return []
    i, depth, cur, out = start + len(opcode) + 1, 1, [], []
    while i < len(line) and depth:
        ch = line[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if depth == 0 or (ch == "," and depth == 1):
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    return [o for o in out if o]


def _result_types(lines):
    """{instruction name: the text before its opcode (its result type)} of a computation."""
    types = {}
    for opcode, line in lines:
        m = bench_update._INSTR_RE.match(line)
        if m:
            rest = m.group(2)
            types[m.group(1).lstrip("%")] = rest[:rest.find(opcode + "(")]
    return types


def _is_f8_dot(opcode, line, types):
    if opcode not in _DOT_OPCODES:
        return False
    for operand in _operands(line, opcode):
        if "f8e" in operand:                       # operand printed with its type
            return True
        name = operand.split()[-1].lstrip("%")     # operand printed by name only
        if "f8e" in types.get(name, ""):
            return True
    return False


def _callees(line):
    m = bench_update._CALLEE_RE.search(line)
    return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []


def analyze_hlo(hlo_text):
    """Counts from the compiled HLO text (entry computation, command buffers looked into).

    kernels: non-trivial instructions (fusions, custom calls, copies, ...); fusions;
    custom_calls and custom_call_targets (by target); f8_gemm_fusions: fusions whose
    body (nested computations included) has a dot with an f8 operand, by backend kind
    (e.g. __triton_gemm); f8_dots_unfused: such dots outside fusions; jax_fp8_update:
    custom calls with that target anywhere in the module.
    """
    comps, entry = bench_update.parse_hlo_computations(hlo_text)
    kernels, by_opcode = bench_update.count_kernels_hlo(hlo_text)
    types = {name: _result_types(lines) for name, lines in comps.items()}
    memo = {}

    def has_f8_dot(name, depth=0):
        if name in memo:
            return memo[name]
        memo[name] = False
        found = False
        for opcode, line in comps.get(name, ()):
            if _is_f8_dot(opcode, line, types.get(name, {})):
                found = True
                break
            if depth < 8 and any(has_f8_dot(c, depth + 1) for c in _callees(line)):
                found = True
                break
        memo[name] = found
        return found

    targets, f8_fusions, f8_dots, fusion_kinds = {}, {}, 0, {}

    def visit(name, depth):
        nonlocal f8_dots
        for opcode, line in comps.get(name, ()):
            if opcode in bench_update._FREE_OPCODES:
                continue
            if opcode in bench_update._NESTING_OPCODES and depth < 8:
                callees = _callees(line)
                if callees:
                    for c in callees:
                        visit(c, depth + 1)
                    continue
            if opcode == "custom-call":
                m = _TARGET_RE.search(line)
                t = m.group(1) if m else "?"
                targets[t] = targets.get(t, 0) + 1
            elif opcode == "fusion":
                m = _BACKEND_KIND_RE.search(line) or _FUSION_KIND_RE.search(line)
                kind = m.group(1) if m else "?"
                fusion_kinds[kind] = fusion_kinds.get(kind, 0) + 1
                if any(has_f8_dot(c) for c in _callees(line)):
                    f8_fusions[kind] = f8_fusions.get(kind, 0) + 1
            elif _is_f8_dot(opcode, line, types.get(name, {})):
                f8_dots += 1

    if entry is not None:
        visit(entry, 0)
    return {
        "kernels": kernels,
        "fusions": by_opcode.get("fusion", 0),
        "custom_calls": by_opcode.get("custom-call", 0),
        "custom_call_targets": dict(sorted(targets.items())),
        "cublas_f8": targets.get(CUBLAS_F8, 0),
        "f8_gemm_fusions": sum(f8_fusions.values()),
        "f8_gemm_fusions_by_kind": dict(sorted(f8_fusions.items())),
        "f8_dots_unfused": f8_dots,
        "fusion_kinds": dict(sorted(fusion_kinds.items())),
        "by_opcode": by_opcode,
        # Anywhere in the module (also inside a computation the walk does not enter).
        "jax_fp8_update": hlo_text.count(f'custom_call_target="{UPDATE_TARGET}"'),
    }


def check_update_calls(variant, hlo):
    """jax_fp8: exactly one jax_fp8_update custom call; its no-update twin: none."""
    n = hlo["jax_fp8_update"]
    if variant in ("jax_fp8", "jax_fp8_packed"):
        assert n == 1, (f"jax_fp8 step: expected exactly one {UPDATE_TARGET} custom call in the "
                        f"compiled HLO, found {n} (is jax_fp8's kernel for this backend "
                        f"built? HAS_CPU_KERNEL={jax_fp8.HAS_CPU_KERNEL}, "
                        f"HAS_CUDA_KERNEL={jax_fp8.HAS_CUDA_KERNEL})")
    elif variant.startswith("jax_fp8") and variant.endswith("_noupdate"):
        assert n == 0, f"{variant} step: expected no {UPDATE_TARGET}, found {n}"


# --------------------------------------------------------------------------------------
# Measuring one variant.
# --------------------------------------------------------------------------------------

def _first_history(variant, state):
    """The first FP8 amax history of the state (to check whether the state moved)."""
    if variant.startswith("flax_fp8"):
        tree = state.params[FLAX_OWG]
        leaves = [v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
                  if "amax_history" in jax.tree_util.keystr(p)]
        return leaves[0] if leaves else None
    if variant.startswith("jax_fp8"):
        states = jax.tree.leaves(state.fp8, is_leaf=lambda s: isinstance(s, jax_fp8.ScalingState))
        return states[0].amax_history if states else None
    return None


def _memory(compiled):
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend/version reports it
        return {}
    if ma is None:
        return {}
    out = {}
    for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes"):
        v = getattr(ma, k, None)
        if v is not None:
            out[k] = int(v)
    return out


def _peak_bytes():
    try:
        stats = jax.devices()[0].memory_stats()
        return None if not stats else stats.get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001
        return None


def measure_variant(variant, args, x, y, platform_name, start_state=None):
    """Measures one variant; returns (result dict, its final train state).

    start_state: the train state to start from (default: a fresh one). A no-update twin
    starts from its updating twin's final state, so it runs with the same calibrated
    scales: from a fresh state its scales stay 1 and the E5M2 gradients underflow to
    zero, which makes the backward GEMMs faster (zeros) and the model stop training.
    """
    r = {"variant": variant, "d": args.d, "tokens": args.tokens, "blocks": args.blocks}
    t0 = time.perf_counter()
    state = make_state(variant, args, x) if start_state is None else start_state
    r["start"] = "fresh" if start_state is None else "the updating twin's final state"
    jax.block_until_ready(state)
    r["init_s"] = time.perf_counter() - t0
    r["state_arrays"] = len(jax.tree.leaves(state))
    r["param_count"] = int(sum(a.size for a in jax.tree.leaves(
        state.params["params"] if variant.startswith("flax_fp8") else state.params)))

    compiled, info = compile_step(variant, state, x, y)
    r.update(info)
    r["memory"] = _memory(compiled)
    text = compiled.as_text() or ""
    hlo = analyze_hlo(text)
    r["hlo"] = hlo
    if args.save_hlo and args.outdir:
        path = os.path.join(args.outdir, f"hlo_{args.d}x{args.tokens}_{variant}.txt.gz")
        with gzip.open(path, "wt") as fp:
            fp.write(text)
    del text
    log(f"  {variant}: compiled in {r['compile_s']:.1f} s (lower {r['lower_s']:.1f} s); "
        f"{hlo['kernels']} kernels, {hlo['fusions']} fusions, {hlo['custom_calls']} custom "
        f"calls ({hlo['cublas_f8']} {CUBLAS_F8}), {hlo['f8_gemm_fusions']} FP8 GEMM fusions, "
        f"{hlo['f8_dots_unfused']} unfused f8 dots, {UPDATE_TARGET} x{hlo['jax_fp8_update']}")
    check_update_calls(variant, hlo)
    if variant.startswith("jax_fp8"):
        log(f"  {variant}: {hlo['jax_fp8_update']} {UPDATE_TARGET} custom call(s) in the "
            f"compiled step, as asserted "
            f"({'none' if variant.endswith('_noupdate') else 'exactly one'})")

    hist0 = _first_history(variant, state)
    hist0 = None if hist0 is None else np.asarray(hist0).copy()

    def step(s, compiled=compiled):  # bound now: `compiled` is deleted below
        return compiled(s, x, y)

    losses = []
    for _ in range(args.warmup):
        state, loss = step(state)
        jax.block_until_ready((state, loss))
        losses.append(float(loss))
    times, dispatch = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, loss = step(state)
        dispatch.append(time.perf_counter() - t)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    r["step_ms_all"] = [t * 1e3 for t in times]
    r["step_ms"] = statistics.median(times) * 1e3
    r["step_ms_min"] = min(times) * 1e3
    # Host time until the call returned (on a GPU: argument handling + launch; the step
    # then runs asynchronously). The blocked step time includes it, the pipelined one
    # hides it behind the previous step's device time when it is shorter.
    r["dispatch_ms"] = statistics.median(dispatch) * 1e3
    if args.pipelined:
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(args.steps):
            state, loss = step(state)
        jax.block_until_ready((state, loss))
        r["pipelined_ms"] = (time.perf_counter() - t) / args.steps * 1e3
        losses.append(float(loss))
    if args.trace_steps > 0:
        state, tinfo = bench_update.traced_device_time(lambda s: step(s)[0], state,
                                                       args.trace_steps, platform_name,
                                                       top_n=args.top_kernels)
        if "device_us" in tinfo:
            r["device_ms"] = tinfo["device_us"] / 1e3
            r["device_events_per_step"] = tinfo.get("events_per_call")
            r["top_kernels"] = tinfo.get("top_kernels")  # to diff variants kernel by kernel
        else:
            r["device_error"] = tinfo.get("error")
    r["loss_first"], r["loss_last"] = losses[0], losses[-1]
    r["loss_finite"] = bool(all(math.isfinite(v) for v in losses))
    hist = _first_history(variant, state)
    if hist is not None:
        r["fp8_state_moved"] = bool(not np.array_equal(np.asarray(hist), hist0))
    r["peak_bytes"] = _peak_bytes()
    del compiled
    gc.collect()
    extra = "".join(f", {k.split('_')[0]} {r[k]:.3f} ms" for k in
                    ("dispatch_ms", "pipelined_ms", "device_ms") if k in r)
    log(f"  {variant}: step {r['step_ms']:.3f} ms (median of {args.steps}){extra}; "
        f"loss {r['loss_first']:.4g} -> {r['loss_last']:.4g}"
        + ("" if "fp8_state_moved" not in r else
           f"; FP8 state {'updated' if r['fp8_state_moved'] else 'unchanged'}"))
    return r, state


# --------------------------------------------------------------------------------------
# Derived numbers, targets, report.
# --------------------------------------------------------------------------------------

METRICS = (("step_ms", "wall, median"), ("pipelined_ms", "wall, pipelined"),
           ("device_ms", "device time"))


def _size_key(r):
    return (r["d"], r["tokens"])


def derive(results):
    """Per size and metric: speed-up vs bf16 and bookkeeping vs the no-update twin."""
    out = {}
    for size in sorted({_size_key(r) for r in results}, reverse=True):
        rows = {r["variant"]: r for r in results if _size_key(r) == size}
        per_metric = {}
        for metric, _ in METRICS:
            m = {}
            base = rows.get("bf16", {}).get(metric)
            for v, r in rows.items():
                t = r.get(metric)
                if t is None:
                    continue
                e = {"ms": t}
                if base:
                    e["speedup_vs_bf16"] = base / t
                twin = rows.get(TWIN.get(v, ""), {}).get(metric)
                if twin is not None:
                    e["bookkeeping_ms"] = t - twin
                    e["bookkeeping_frac"] = (t - twin) / t
                m[v] = e
            if m:
                per_metric[metric] = m
        out[f"{size[0]}x{size[1]}"] = per_metric
    return out


def evaluate_targets(derived, blocks):
    """The issue's three targets, per size and metric (binding at d=2048, 4096 tokens)."""
    out = []
    for size, per_metric in derived.items():
        d, tokens = (int(s) for s in size.split("x"))
        binding = (d, tokens) == TARGET_SIZE
        for metric, m in per_metric.items():
            j = m.get("jax_fp8")
            if not j:
                continue
            flax_ms = m.get("flax_fp8", {}).get("ms")
            values = {"bookkeeping": j.get("bookkeeping_frac"),
                      "vs_bf16": j.get("speedup_vs_bf16"),
                      "vs_flax": None if flax_ms is None else flax_ms / j["ms"]}
            for key, desc, thr in TARGETS:
                v = values[key]
                met = None if v is None else (v <= thr if key == "bookkeeping" else v >= thr)
                out.append({"size": size, "blocks": blocks, "metric": metric, "target": key,
                            "description": desc, "value": v, "threshold": thr, "met": met,
                            "binding": binding})
    return out


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def markdown_report(data):
    meta, lines = data["meta"], []
    s = meta["settings"]
    lines.append(f"# Train step: bf16 vs Flax FP8 vs jax_fp8 — {meta['device']}")
    lines.append("")
    lines.append(f"{s['blocks']} blocks x 4 Dense (d->3d, d->d, d->4d, 4d->d), bf16 compute, "
                 f"f32 params, TrainState + optax.adam, state donated; history length "
                 f"{s['history_len']}; median of {s['steps']} steps after {s['warmup']} "
                 f"warm-up steps. jax {meta['jax_version']}, flax {meta['flax_version']}, "
                 f"optax {meta['optax_version']}; Flax FP8 op: `{meta['flax_fp8_op']}`. "
                 f"{meta['date']}, commit {meta['git_commit']}, sources {meta.get('source_digest')}.")
    lines.append("")
    lines.append("wall, median: each step followed by block_until_ready; wall, pipelined: "
                 "steps dispatched back to back (per step); device time: the sum of the "
                 "device's op/kernel durations per step in a profiler trace (GPU: the "
                 "kernels); dispatch: host time until the call returns; × vs bf16 > 1 is "
                 "faster; bookkeeping = the variant − its no-update twin (which starts from "
                 "the updating variant's final state: both run with calibrated scales).")
    for size, per_metric in data["derived"].items():
        rows = {r["variant"]: r for r in data["results"]
                if f"{r['d']}x{r['tokens']}" == size}
        d, tokens = size.split("x")
        lines += ["", f"## d = {d}, {tokens} tokens", ""]
        metrics = [(k, lbl) for k, lbl in METRICS if k in per_metric]
        hdr = ["variant"]
        for k, lbl in metrics:
            hdr += [f"{lbl} ms", "× vs bf16", "bookkeeping ms (%)"]
        hdr += ["dispatch ms"]
        lines.append("| " + " | ".join(hdr) + " |")
        lines.append("|" + "---|" * len(hdr))
        for v in VARIANTS:
            r = rows.get(v)
            if r is None:
                continue
            cells = [LABELS[v]]
            for k, _ in metrics:
                e = per_metric[k].get(v, {})
                bk = e.get("bookkeeping_ms")
                bk = "—" if bk is None else f"{bk:+.3f} ({100 * e['bookkeeping_frac']:+.1f} %)"
                cells += [_f(e.get("ms"), "{:.3f}"), _f(e.get("speedup_vs_bf16"), "{:.3f}"), bk]
            cells.append(_f(r.get("dispatch_ms"), "{:.2f}"))
            lines.append("| " + " | ".join(cells) + " |")
        hdr = ["variant", "compile s", "kernels", "fusions", "custom calls", f"`{CUBLAS_F8}`",
               "FP8 GEMM fusions", "`jax_fp8_update`", "state arrays"]
        lines += ["", "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for v in VARIANTS:
            r = rows.get(v)
            if r is None:
                continue
            h = r["hlo"]
            cells = [LABELS[v], _f(r.get("compile_s"), "{:.1f}"), str(h["kernels"]),
                     str(h["fusions"]), str(h["custom_calls"]), str(h["cublas_f8"]),
                     str(h["f8_gemm_fusions"]), str(h["jax_fp8_update"]), str(r["state_arrays"])]
            lines.append("| " + " | ".join(cells) + " |")
        notes = []
        for v in VARIANTS:
            r = rows.get(v)
            if r is None:
                continue
            t = r["hlo"]["custom_call_targets"]
            extra = []
            if r["hlo"]["f8_gemm_fusions_by_kind"]:
                extra.append(f"FP8 GEMM fusions by kind {r['hlo']['f8_gemm_fusions_by_kind']}")
            if r["hlo"]["f8_dots_unfused"]:
                extra.append(f"{r['hlo']['f8_dots_unfused']} unfused f8 dots")
            if "fp8_state_moved" in r:
                extra.append("FP8 state " + ("updated" if r["fp8_state_moved"] else "unchanged")
                             + " by the steps")
            if r.get("patched"):
                extra.append("patched: " + ", ".join(f"`{p}`" for p in r["patched"]))
            extra.append(f"loss {r['loss_first']:.4g} -> {r['loss_last']:.4g}")
            notes.append(f"- {v}: custom calls {t or '{}'}; " + "; ".join(extra))
        lines += ["", *notes]
    if data["targets"]:
        lines += ["", f"## Targets (binding at d = {TARGET_SIZE[0]}, {TARGET_SIZE[1]} tokens)", "",
                  "| size | metric | target | value | |", "|---|---|---|---|---|"]
        for t in data["targets"]:
            v = t["value"]
            val = "—" if v is None else (f"{100 * v:+.2f} %" if t["target"] == "bookkeeping"
                                         else f"{v:.3f}x")
            verdict = "n/a" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
            if not t["binding"]:
                verdict += " (not the target size)"
            lines.append(f"| {t['size']} | {dict(METRICS)[t['metric']]} | {t['description']} | "
                         f"{val} | {verdict} |")
    if data.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{s['size']} {s['variant']} ({s['reason']})"
                                              for s in data["skipped"])]
    if data.get("failures"):
        lines += ["", "Failures: " + "; ".join(f"{f['size']} {f['variant']}: {f['error']}"
                                               for f in data["failures"])]
    lines += ["", f"Command: `{meta['command']}`"]
    return "\n".join(lines)


def assemble(meta, results, failures=(), skipped=(), partial=False):
    derived = derive(results)
    data = {"meta": meta, "results": list(results), "derived": derived,
            "targets": evaluate_targets(derived, meta["settings"]["blocks"]),
            "failures": list(failures), "skipped": list(skipped), "partial": partial}
    data["report_markdown"] = markdown_report(data)
    return data


# --------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------

def _sizes(text):
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"(\d+)x(\d+)", item)
        if not m:
            raise argparse.ArgumentTypeError(f"sizes are DxTOKENS, e.g. 2048x4096; got {item!r}")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise argparse.ArgumentTypeError("no sizes given")
    return out


def _variants(text):
    out = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in out if v not in VARIANTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"variants are a comma-separated subset of "
                                         f"{','.join(VARIANTS)}; got {text!r}")
    return out


def build_parser():
    p = argparse.ArgumentParser(
        description="Benchmark a whole Flax train step: bf16, Flax FP8 and jax_fp8, each with "
                    "and without its FP8 bookkeeping (see bench/README.md).",
        epilog=__doc__[__doc__.index("Examples:"):],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=24, help="blocks of 4 Dense (default 24)")
    p.add_argument("--d", type=int, default=2048, help="model width d (default 2048)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per step, batch x seq flattened (default 4096)")
    p.add_argument("--small", action="store_true", help="preset: --d 1024 --tokens 1024")
    p.add_argument("--sizes", type=_sizes, default=None, metavar="DxT[,DxT...]",
                   help="several sizes in one run, e.g. 2048x4096,1024x1024 (overrides "
                        "--d/--tokens/--small; run in the order given)")
    p.add_argument("--variants", type=_variants, default=list(VARIANTS),
                   help="comma-separated subset of " + ",".join(VARIANTS) + " (default: all; "
                        "run order " + ",".join(RUN_ORDER) + ")")
    p.add_argument("--steps", type=int, default=10,
                   help="timed steps per variant (default 10; the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    p.add_argument("--trace-steps", type=int, default=None,
                   help="steps in a profiler trace for the device time (default 3 on a GPU, "
                        "0 = no trace elsewhere)")
    p.add_argument("--no-trace", action="store_true", help="no profiler trace")
    p.add_argument("--no-pipelined", dest="pipelined", action="store_false",
                   help="skip the back-to-back (pipelined) timing")
    p.add_argument("--history-len", type=int, default=1024,
                   help="amax history length, Flax and jax_fp8 alike (default 1024, both "
                        "libraries' default)")
    p.add_argument("--lr", type=float, default=1e-4, help="adam learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no variant that, judging by the slowest compile + measurement "
                        "so far (x1.25), would end after this many seconds; skips are listed")
    p.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache directory (a rerun on the same "
                        "machine then skips most compile time)")
    p.add_argument("--top-kernels", type=int, default=40, metavar="N",
                   help="record the N kernels with the most device time per variant in "
                        "results.json (default 40)")
    p.add_argument("--save-hlo", action="store_true",
                   help="also write each compiled HLO to OUTDIR/hlo_<size>_<variant>.txt.gz")
    p.add_argument("--outdir", metavar="DIR", default=None,
                   help="write DIR/results.json and DIR/results.md")
    return p


def _finalize(args):
    if args.sizes is None:
        args.sizes = [(1024, 1024)] if args.small else [(args.d, args.tokens)]
    if args.trace_steps is None:
        args.trace_steps = 3 if bench_update._platform() == "gpu" else 0
    if args.no_trace:
        args.trace_steps = 0
    for name in ("blocks", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    args.warmup = max(0, args.warmup)
    if args.steps < 10:
        log(f"note: --steps {args.steps} < 10: a smoke run, not a measurement")
    args.order = [v for v in RUN_ORDER if v in args.variants]
    return args


def collect_meta(args, argv):
    return {
        **bench_update.environment_meta(__file__, argv),
        "flax_version": getattr(flax, "__version__", None),
        "optax_version": getattr(optax, "__version__", None),
        "flax_fp8_op": f"flax.linen.fp8_ops.{FLAX_OP.__name__}",
        "settings": {"blocks": args.blocks, "sizes": [f"{d}x{t}" for d, t in args.sizes],
                     "variants": list(args.variants), "steps": args.steps,
                     "warmup": args.warmup, "trace_steps": args.trace_steps,
                     "pipelined": args.pipelined, "history_len": args.history_len,
                     "lr": args.lr, "seed": args.seed, "time_limit": args.time_limit},
    }


def _write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as fp:
        json.dump(data, fp, indent=1, default=bench_update._json_default)
    os.replace(tmp, path)


def _write_outputs(outdir, data):
    _write_json(os.path.join(outdir, "results.json"), data)
    md = data["report_markdown"]
    if data.get("partial"):
        md = "(partial results: written after each variant; the run had not finished)\n\n" + md
    tmp = os.path.join(outdir, "results.md.tmp")
    with open(tmp, "w") as fp:
        fp.write(md + "\n")
    os.replace(tmp, os.path.join(outdir, "results.md"))


def run(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _finalize(build_parser().parse_args(argv))
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        for opt, val in (("jax_persistent_cache_min_compile_time_secs", 0.0),
                         ("jax_persistent_cache_min_entry_size_bytes", 0)):
            try:
                jax.config.update(opt, val)
            except Exception:  # noqa: BLE001 - an option this jax does not have
                pass
    platform_name = bench_update._platform()
    meta = collect_meta(args, argv)
    log(f"train-step bench: {meta['device']} ({platform_name}), jax {meta['jax_version']}, "
        f"flax {meta['flax_version']}, {args.blocks} blocks, sizes {meta['settings']['sizes']}, "
        f"variants {args.order}; Flax FP8 op {FLAX_OP.__name__}")
    if platform_name == "gpu" and not jax_fp8.HAS_CUDA_KERNEL:
        log("WARNING: jax_fp8's CUDA kernel is not loaded: the jax_fp8 step would run the jnp "
            "fallback (and fail the one-custom-call assertion)")
    out_json = None
    if args.outdir:
        os.makedirs(args.outdir, exist_ok=True)
        out_json = os.path.join(args.outdir, "results.json")
    t_all = time.perf_counter()
    results, failures, skipped, slowest = [], [], [], 0.0
    finals = {}  # no-update twin -> its updating twin's final train state
    for d, tokens in args.sizes:
        args.d, args.tokens = d, tokens
        size = f"{d}x{tokens}"
        rng = np.random.default_rng(args.seed)
        x = jnp.asarray(rng.standard_normal((tokens, d), np.float32), jnp.bfloat16)
        y = jnp.asarray(rng.standard_normal((tokens, d), np.float32), jnp.bfloat16)
        log(f"[{size}] {args.blocks} blocks, "
            f"{12 * args.blocks * d * d / 1e6:.1f} M Dense parameters")
        for variant in args.order:
            elapsed = time.perf_counter() - t_all
            if (args.time_limit is not None and (results or failures)
                    and elapsed + 1.25 * slowest > args.time_limit):
                reason = (f"--time-limit {args.time_limit:g} s: {elapsed:.0f} s elapsed, "
                          f"~{slowest:.0f} s per variant")
                skipped.append({"size": size, "variant": variant, "reason": reason})
                log(f"  {variant}: skipped ({reason})")
                continue
            t0 = time.perf_counter()
            try:
                r, final_state = measure_variant(variant, args, x, y, platform_name,
                                                 start_state=finals.pop(variant, None))
                results.append(r)
                if TWIN.get(variant) in args.order:  # the twin starts where this ended
                    finals[TWIN[variant]] = final_state
                del final_state
            except AssertionError:
                raise
            except Exception as err:  # noqa: BLE001 - keep the other variants
                traceback.print_exc(file=sys.stderr)
                failures.append({"size": size, "variant": variant,
                                 "error": f"{type(err).__name__}: {err}"})
                log(f"  {variant}: FAILED: {err}")
                gc.collect()
            slowest = max(slowest, time.perf_counter() - t0)
            log(f"  {variant}: done in {time.perf_counter() - t0:.1f} s "
                f"(total {time.perf_counter() - t_all:.1f} s)")
            if out_json:  # a killed run keeps what it measured
                _write_outputs(args.outdir, assemble(meta, results, failures, skipped,
                                                     partial=True))
        del x, y
        finals.clear()
        _INIT_CACHE.clear()
        gc.collect()
    meta["total_s"] = round(time.perf_counter() - t_all, 1)
    data = assemble(meta, results, failures, skipped)
    if out_json:
        _write_outputs(args.outdir, data)
        log(f"wrote {out_json} and results.md")
    print(data["report_markdown"])
    for t in data["targets"]:
        if t["binding"]:
            log(f"target ({dict(METRICS)[t['metric']]}) {t['description']}: "
                f"{'n/a' if t['met'] is None else ('MET' if t['met'] else 'NOT MET')}")
    log(f"total {meta['total_s']:.1f} s")
    return data


def main(argv=None):
    data = run(argv)
    return 1 if data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
