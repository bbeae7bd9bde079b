#!/usr/bin/env python3
"""Benchmark: data-parallel, FSDP and tensor-parallel FP8 train steps on every local device.

The model, variants, train states and steps are bench_train_step.py's (N pre-LN blocks x
4 Dense, bf16 compute, float32 parameters, TrainState + optax.adam, the state donated),
run on all local devices (GPUs, or host CPUs with
XLA_FLAGS=--xla_force_host_platform_device_count=N) in three modes:

  dp     mesh (data,): parameters, adam state and FP8 state replicated, batch sharded
  fsdp   mesh (data,) or (data, fsdp): every kernel (and its adam moments) split on its
         rows over the fsdp axis ("data" on a 1-D mesh), batch over every axis
  tp     mesh (data, model), Megatron style: in3 and up split on their columns
         (column-parallel), out and down on their rows (row-parallel, their partial
         outputs summed over "model"), batch over "data"

The block's a, b, c are taken interleaved in G groups (bench_train_step.Block's
``groups``, G = the tp mesh's model axis) so that a column-parallel in3 hands each device
whole slices of a, b and c; the model is the same in every mode. LayerNorm parameters
and the FP8 state are replicated in every mode.

Per mode and variant (bf16, flax_fp8, jax_fp8 by default; any of bench_train_step's):
compile time; device time per step from a profiler trace (the mean over devices of
their kernels' summed durations; "busy": the union of their intervals, as collective
kernels overlap compute on other streams), wall time per step pipelined and blocked;
the collectives of the compiled step and of the program right after XLA's SPMD
partitioner (compilation.partitioned, a second compile left out of the compile time: FP8
all-gathers are still FP8 there, XLA:CPU widens them later), with the mesh axes each
one spans; the `maximum` all-reduces (jax_fp8: exactly 1, every amax in one) and
jax_fp8_update calls (1); the weight all-gathers (fsdp; jax_fp8's must be FP8, their
bytes are set against bf16's); the collective kernels' device time per step by kind
(collective_kind, event_kind); whether every replicated leaf of the state is
bit-identical on every device after all the steps; the ratios to bf16 and to Flax FP8
of this run.

NCCL_NVLS_ENABLE defaults to 0 here, before jax starts (NVLink multicast stays off).
Progress goes to stderr, the markdown report to stdout; OUTDIR/results.json and
results.md are rewritten after every (mode, variant). Exit status 1 when a variant
failed or a check did not hold.

Examples:
  python bench/bench_multigpu.py --outdir out/bench_multigpu            # every local GPU
  python bench/bench_multigpu.py --modes fsdp,tp --mesh fsdp=2x4,tp=4x2 --variants bf16,jax_fp8
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python bench/bench_multigpu.py --smoke --outdir /tmp/bench_multigpu   # CPU, tiny sizes
"""

from __future__ import annotations

import os

# NVLink multicast (NCCL's NVLS algorithms) must stay off on the target machines. NCCL
# reads the variable when jax creates its communicators, so it is set before jax is
# imported; a value given by the caller wins.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import bench_train_step as bts  # noqa: E402  (the model, variants, states, steps, timing)
import common  # noqa: E402
import jax_fp8  # noqa: E402
from jax_fp8.devtools import compilation, hlo, trace  # noqa: E402

MODES = ("dp", "fsdp", "tp")
DEFAULT_VARIANTS = ("bf16", "flax_fp8", "jax_fp8")
COLUMN_PARALLEL = ("in3", "up")   # tp: kernels split on their columns (outputs)
ROW_PARALLEL = ("out", "down")    # tp: split on their rows; partial outputs summed
SMOKE = {"layers": 1, "d": 64, "tokens": 64, "steps": 2, "warmup": 1, "trace_steps": 1,
         "history_len": 16}


# --------------------------------------------------------------------------------------
# Meshes and shardings.
# --------------------------------------------------------------------------------------

def default_mesh(mode, n):
    """dp and fsdp: all n devices on one axis; tp: a model axis of 2 (4 from 8 devices
    on), the rest data: 2 -> 1x2, 4 -> 2x2, 8 -> 2x4."""
    if mode != "tp":
        return (n,)
    model = 4 if n >= 8 and n % 4 == 0 else 2 if n % 2 == 0 else 1
    return (n // model, model)


def axis_names(mode, shape):
    names = {("dp", 1): ("data",), ("fsdp", 1): ("data",), ("fsdp", 2): ("data", "fsdp"),
             ("tp", 2): ("data", "model")}.get((mode, len(shape)))
    if names is None:
        raise SystemExit(f"--mesh: {mode} takes a mesh of "
                         + {"dp": "1", "fsdp": "1 or 2", "tp": "2"}[mode]
                         + f" axes, got {'x'.join(map(str, shape))}")
    return names


def make_mesh(mode, shape):
    """The mode's mesh over the first prod(shape) devices, Auto axes."""
    n = math.prod(shape)
    return jax.make_mesh(shape, axis_names(mode, shape), devices=jax.devices()[:n],
                         axis_types=(AxisType.Auto,) * len(shape))


def batch_spec(mesh):
    """Tokens over every axis but "model"."""
    axes = tuple(a for a in mesh.axis_names if a != "model")
    return P(axes if len(axes) > 1 else axes[0], None)


def kernel_spec(mode, mesh, layer):
    if mode == "fsdp":
        return P(mesh.axis_names[-1], None)   # rows over "fsdp", or "data" on a 1-D mesh
    if mode == "tp":
        return P(None, "model") if layer in COLUMN_PARALLEL else P("model", None)
    return P()


def _kernel_layer(path, leaf):
    """The Dense layer name ("in3", ...) of a ``...[layer]['kernel']`` leaf (parameters and
    adam's moments alike), else None (LayerNorm parameters, FP8 state, counters)."""
    keys = [getattr(k, "key", None) for k in path]
    if (len(keys) >= 2 and keys[-1] == "kernel" and getattr(leaf, "ndim", 0) == 2
            and keys[-2] in COLUMN_PARALLEL + ROW_PARALLEL):
        return keys[-2]
    return None


def state_shardings(state, mode, mesh):
    """A NamedSharding per leaf of a train state: kernels by the mode, the rest replicated."""
    def spec(path, leaf):
        layer = _kernel_layer(path, leaf)
        return NamedSharding(mesh, kernel_spec(mode, mesh, layer) if layer else P())
    return jax.tree_util.tree_map_with_path(spec, state)


# --------------------------------------------------------------------------------------
# The compiled and the partitioned program: collectives.
# --------------------------------------------------------------------------------------

def compile_step(lowered, one_compile=False):
    """(compiled, compile_s, HLO text right after XLA's SPMD partitioner).

    The partitioned program comes from a second compile (compilation.partitioned, which dumps that
    pass), left out of compile_s: dumping makes XLA:GPU write more than that pass (its
    LLVM IR, say). ``one_compile`` (--smoke) saves the second compile: the same dump rides
    on the timed compile."""
    if not one_compile:
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        return compiled, compile_s, compilation.partitioned(lowered)
    t0 = time.perf_counter()
    compiled, text = compilation.compile_partitioned(lowered)
    return compiled, time.perf_counter() - t0, text


_IOTA_TEXT = r"\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?"
_MESH_TEXT = (r"mesh\[(?:'\w+'=\d+,?)+\](?:,\s*device_ids=\((?:" + _IOTA_TEXT
              + r"|[\d,\s]+)\))?\s*\{(?:'\w+',?\s*)*\}")
_GROUPS = re.compile(r"replica_groups=(\{[\d,{} ]*\}|" + _IOTA_TEXT + "|" + _MESH_TEXT
                     + r")(?=[,\s]|$)")
_IOTA = re.compile(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?")
_XLA_MESH = re.compile(r"mesh\[((?:'\w+'=\d+,?)+)\](?:,\s*device_ids=\(([^{]*)\))?\s*\{(.*)\}")
_DONE_OPERAND = re.compile(r"-done\(\s*%?([^\s,)]+)")


def _ints(text):
    return [int(v) for v in text.split(",") if v.strip()] if text else None


def _iota(text):
    """XLA's iota tile: ``[2,2]<=[4]``, ``[2,2]<=[2,2]T(1,0)``, ``[2,2]T(1,0)``: the ids
    0..n-1 laid out in the second shape (the first where there is none), transposed,
    reshaped to the first shape."""
    shape, dims, perm = (_ints(g) for g in _IOTA.fullmatch(text).groups())
    ids = np.arange(math.prod(shape)).reshape(dims or shape)
    return (ids.transpose(perm) if perm else ids).reshape(shape)


def _mesh_groups(text):
    """``mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_1'}``: the device ids
    laid out over the named mesh (in order where device_ids is not given); one group per
    position on the axes not listed, over the listed ones."""
    m = _XLA_MESH.fullmatch(text)
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(v) for _, v in axes]
    ids = np.arange(math.prod(sizes))
    if m.group(2):
        ids = (_iota(m.group(2)) if m.group(2).startswith("[") else np.array(_ints(m.group(2))))
    over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(3))]
    rest = [i for i in range(len(names)) if i not in over]
    ids = ids.reshape(sizes).transpose(rest + over)
    return ids.reshape(-1, math.prod(sizes[i] for i in over)).tolist()


def replica_groups(line, n):
    """The device groups of a collective's HLO line, in any of XLA's three spellings:
    explicit ``{{0,1},{2,3}}``, an iota tile ``[2,2]<=[2,2]T(1,0)``, or axes of a device
    mesh ``mesh['axis_0'=2,'axis_1'=2] {'axis_1'}``; all n devices where none are given
    (or ``{}``); None where the spelling is not understood."""
    m = _GROUPS.search(line)
    if m is None:
        return None if "replica_groups=" in line else [list(range(n))]
    text = m.group(1)
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if text.startswith("["):
        return _iota(text).tolist()
    groups = [g for g in (_ints(g) for g in re.findall(r"\{([\d, ]*)\}", text)) if g]
    return groups or [list(range(n))]


def group_axes(groups, mesh):
    """The mesh axes a collective's groups span ("?": groups not understood). Device id i
    of the (SPMD) program is mesh.devices.flat[i], at np.unravel_index(i, mesh shape)."""
    if groups is None:
        return ("?",)
    shape = tuple(mesh.shape.values())
    axes = set()
    for g in groups:
        coords = np.array([np.unravel_index(i, shape) for i in g])
        axes |= {mesh.axis_names[a] for a in range(len(shape)) if len(set(coords[:, a])) > 1}
    return tuple(a for a in mesh.axis_names if a in axes)


def collective_kind(opcode, reduction, axes):
    """What a collective does in these steps: every `maximum` all-reduce is an amax (no
    other max crosses devices here); a sum over "model" only is tensor parallelism's
    partial outputs / input gradients; other sums are gradients (and the scalar loss)."""
    if opcode == "all-reduce" and reduction == "maximum":
        return "amax all-reduce"
    if opcode in ("all-reduce", "reduce-scatter") and reduction == "add":
        return f"tp {opcode} (activations)" if axes == ("model",) else f"gradient {opcode}"
    return opcode + (f" ({reduction})" if reduction else "")


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def _dims(shape):
    """The dimensions of a one-array HLO type, e.g. "f8e4m3fn[16,192]{1,0}" -> (16, 192)."""
    arrays = _ARRAY.findall(shape)
    return tuple(int(v) for v in arrays[0][1].split(",") if v) if len(arrays) == 1 else None


def _operands(ins):
    """The operand names of an instruction (a tuple element's as its tuple's name)."""
    return [o.partition("#")[0] for o in hlo.operands(ins)]


def _from_parameter(name, by_name, limit=64):
    """Whether the value ``name`` is a parameter of the program passed through one chain
    of shape-preserving ops whose other operands are broadcasts or constants (convert,
    scale, clamp: a weight shard's quantization) and transposes (the layout the forward
    GEMM takes), not an activation or gradient, which the step computes from several
    arrays of its shape."""
    want = _dims(by_name[name].shape)
    for _ in range(limit):
        ins = by_name[name]
        if ins.opcode == "parameter":
            return True
        ops = [o for o in _operands(ins) if o in by_name]
        if ins.opcode == "transpose" and len(ops) == 1:
            name, want = ops[0], _dims(by_name[ops[0]].shape)
            continue
        chain = [o for o in ops
                 if by_name[o].opcode not in ("broadcast", "constant", "iota")
                 and _dims(by_name[o].shape) == want]
        if len(chain) != 1:
            return False
        name = chain[0]
    return False


def weight_gather_names(text, size):
    """{instruction name: (dtype, bytes)} of the program's all-gathers of whole kernels: of
    a parameter shard (through its quantization) into an array shaped like one of the
    model's kernels. (The shape alone could be an activation's or a gradient's, e.g. with
    tokens == d; a combined all-gather of several arrays is not attributed.)"""
    d = size[0]
    kernels = {(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)}
    kernels |= {(b, a) for a, b in kernels}   # as stored, or transposed for the forward GEMM
    out = {}
    for comp in hlo.parse(text).computations.values():
        by_name = {ins.name: ins for ins in comp}
        for ins in comp:
            if ins.opcode not in ("all-gather", "all-gather-start"):
                continue
            arrays = _ARRAY.findall(ins.shape)   # an async start's: (operand, result)
            arrays = arrays[-1:] if ins.opcode.endswith("-start") else arrays
            ops = _operands(ins)
            if len(arrays) != 1 or len(ops) != 1 or ops[0] not in by_name:
                continue
            array = "{}[{}]".format(*arrays[0])
            if _dims(array) in kernels and _from_parameter(ops[0], by_name):
                out[ins.name] = (arrays[0][0], hlo.shape_bytes(array))
    return out


def gather_summary(names):
    """{count, bytes, dtypes: {dtype: bytes}} of `weight_gather_names`."""
    out = {"count": len(names), "bytes": sum(b for _, b in names.values()), "dtypes": {}}
    for dtype, nbytes in names.values():
        out["dtypes"][dtype] = out["dtypes"].get(dtype, 0) + nbytes
    return out


def collective_list(text, mesh, weights=()):
    """Every collective of an HLO program: name, opcode, reduction, dtypes, bytes, the mesh
    axes it spans and its kind (``weights``: the names of the weight all-gathers)."""
    mod = hlo.parse(text)
    lines = {ins.name: ins.line for comp in mod.computations.values() for ins in comp}
    out = []
    for c in hlo.collectives(mod):
        axes = group_axes(replica_groups(lines.get(c.name, ""), mesh.size), mesh)
        kind = ("weight all-gather" if c.name in weights
                else collective_kind(c.opcode, c.reduction, axes))
        out.append({"name": c.name, "opcode": c.opcode, "reduction": c.reduction,
                    "dtypes": list(c.dtypes), "bytes": c.bytes, "axes": list(axes),
                    "kind": kind})
    return out


def collective_summary(colls):
    """{opcode: {count, bytes, dtypes: {dtype: count}}}."""
    out = {}
    for c in colls:
        e = out.setdefault(c["opcode"], {"count": 0, "bytes": 0, "dtypes": {}})
        e["count"] += 1
        e["bytes"] += c["bytes"]
        for dt in c["dtypes"]:
            e["dtypes"][dt] = e["dtypes"].get(dt, 0) + 1
    return dict(sorted(out.items()))


def kinds_by_kernel(text, colls):
    """{kernel name: kind} for the compiled step's collectives, async ``-done`` halves
    included (a trace may name either)."""
    kinds = {hlo.kernel_name(c["name"]): c["kind"] for c in colls}
    for comp in hlo.parse(text).computations.values():
        for ins in comp:
            m = _DONE_OPERAND.search(ins.line) if ins.opcode.endswith("-done") else None
            if m and hlo.kernel_name(m.group(1)) in kinds:
                kinds[hlo.kernel_name(ins.name)] = kinds[hlo.kernel_name(m.group(1))]
    return kinds


# --------------------------------------------------------------------------------------
# The trace: device time per device, collective time by kind.
# --------------------------------------------------------------------------------------

# NCCL kernels: ncclDevKernel_AllReduce_Sum_f32_RING_LL, ncclKernel_AllReduce_RING_LL_Sum_float, ...
_NCCL_OP = re.compile(r"(AllReduce|AllGather|ReduceScatter|SendRecv|AllToAll|Broadcast)", re.I)
_NCCL_REDUCTION = re.compile(r"_(Sum|Max|Min|Prod|PreMulSum|SumPostDiv)(?:_|$)", re.I)


def event_device(e):
    """The device of a trace event: GPU processes are one per device (pid); the CPU
    runtime's op events name theirs (device_ordinal)."""
    return (e.get("args") or {}).get("device_ordinal", e.get("pid"))


def event_kind(e, kinds, ops):
    """The collective kind of a device event, or None for other kernels: by the HLO
    instruction the event names (its hlo_op argument, or its name on CPU), else, for an
    NCCL kernel the HLO does not name, by the NCCL operation and reduction in its name
    (no mesh axes then: "all-reduce (sum)", not gradient vs tp)."""
    name = str(e.get("name", ""))
    for key in ((e.get("args") or {}).get("hlo_op"), name):
        if key and hlo.kernel_name(str(key)) in kinds:
            return kinds[hlo.kernel_name(str(key))]
    if not trace.kernel_family(name, ops).startswith("collective"):
        return None
    m, red = _NCCL_OP.search(name), _NCCL_REDUCTION.search(name)
    if not m:
        return "collective (unattributed)"
    op, red = m.group(1).lower(), red.group(1).lower() if red else ""
    if op == "allreduce":
        return "amax all-reduce" if red == "max" else f"all-reduce ({red or '?'})"
    return {"allgather": "all-gather", "reducescatter": "reduce-scatter",
            "sendrecv": "collective-permute", "alltoall": "all-to-all"}.get(op, op)


def _busy_us(events):
    """The union of the events' intervals, µs (overlapping streams counted once)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                   for e in events if "ts" in e)
    busy, end = 0.0, -math.inf
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def traced(step, state, steps, ops, kinds):
    """(state, figures) from a profiler trace of ``steps`` steps, per step and device."""
    state, events = trace.capture(step, state, steps=steps)
    dev = trace.device_events(events)
    if not dev:
        return state, {"trace_error": "no device events in the trace"}
    per_device = collections.defaultdict(list)
    for e in dev:
        per_device[event_device(e)].append(e)
    n = len(per_device)   # devices in the trace: all of the mesh's, on GPU and CPU
    times = [trace.total_us(v) / steps / 1e3 for v in per_device.values()]
    coll = collections.defaultdict(float)
    for e in dev:
        kind = event_kind(e, kinds, ops)
        if kind:
            coll[kind] += float(e.get("dur", 0.0)) / steps / n / 1e3
    fam = trace.by_family(dev, ops)
    return state, {
        "devices_in_trace": n,
        "device_ms": sum(times) / n, "device_ms_max": max(times),
        "busy_ms": sum(_busy_us(v) for v in per_device.values()) / steps / n / 1e3,
        "families_ms": {k: round(v / steps / n / 1e3, 5) for k, v in fam.items()},
        "collective_ms": {k: round(v, 5) for k, v in sorted(coll.items(), key=lambda kv: -kv[1])},
        "collective_total_ms": sum(coll.values())}


# --------------------------------------------------------------------------------------
# Replicas.
# --------------------------------------------------------------------------------------

def replica_check(state):
    """Compares, for every array of the state, the addressable shards that hold the same
    slice (its replicas: all of a replicated leaf's, those along the mesh axes a sharded
    leaf is not split on) byte for byte."""
    leaves = replicated = 0
    mismatched = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not isinstance(leaf, jax.Array):
            continue
        leaves += 1
        copies = collections.defaultdict(list)
        for s in leaf.addressable_shards:
            copies[tuple((i.start, i.stop, i.step) for i in s.index)].append(s)
        groups = [g for g in copies.values() if len(g) > 1]
        if not groups:
            continue
        replicated += 1
        if any(np.asarray(g[0].data).tobytes() != np.asarray(o.data).tobytes()
               for g in groups for o in g[1:]):
            mismatched.append(jax.tree_util.keystr(path))
    return {"leaves": leaves, "replicated_leaves": replicated, "mismatched": mismatched,
            "bit_identical": not mismatched}


# --------------------------------------------------------------------------------------
# One (mode, variant).
# --------------------------------------------------------------------------------------

def checks(variant, r, mesh, recipe=None):
    """The properties that must hold; each failure is a string in r["check_errors"].
    ``recipe``: a jax_fp8 variant's. Delayed scaling: one `maximum` all-reduce for every
    amax of the step; delayed and current scaling: FP8 weight all-gathers under FSDP
    (block scaling has no partitioning rule yet: docs/multi_device.md)."""
    errors = []
    bts.check_update_calls(variant, r)            # jax_fp8: one jax_fp8_update
    if "check_error" in r:
        errors.append(r.pop("check_error"))
    maxima = r["all_reduce_kinds"].get("maximum", 0)
    if isinstance(recipe, jax_fp8.DelayedScaling) and mesh.size > 1 and maxima != 1:
        errors.append(f"{maxima} `maximum` all-reduces in the compiled step, expected 1")
    gathers = r["weight_all_gathers"]["dtypes"]
    per_tensor = isinstance(recipe, (jax_fp8.DelayedScaling, jax_fp8.Float8CurrentScaling))
    if per_tensor and r["mode"] == "fsdp" and set(gathers) - {"f8e4m3fn", "f8e5m2"}:
        errors.append(f"weight all-gathers not all FP8: {gathers}")
    if not r.get("replicas", {}).get("bit_identical", True):
        errors.append(f"replicas differ: {r['replicas']['mismatched'][:5]}")
    if not r.get("loss_finite", True):
        errors.append("a loss was not finite")
    if errors:
        r["check_errors"] = errors


def inspect_programs(text, part_text, mesh, size):
    """What the compiled step (``text``) and the partitioned program hold: bench_train_step's
    HLO counts, all-reduces by reduction, collectives (listed and by opcode), weight
    all-gathers."""
    weights, part_weights = weight_gather_names(text, size), weight_gather_names(part_text, size)
    colls = collective_list(text, mesh, weights)
    part = collective_list(part_text, mesh, part_weights)
    return {"hlo": bts.analyze(hlo.parse(text)), "all_reduce_kinds": hlo.all_reduce_kinds(text),
            "collectives": collective_summary(colls),
            "partitioned_collectives": collective_summary(part),
            "weight_all_gathers": gather_summary(part_weights),
            "weight_all_gathers_compiled": gather_summary(weights),
            "collective_list": colls, "partitioned_collective_list": part}


def measure(mode, mesh, variant, args, host_xy, progress):
    """Measures one variant in one mode; returns its result row."""
    size = (args.d, args.layers, args.tokens)
    tag = f"{mode} {variant.name}"
    r = {"mode": mode, "variant": variant.name, "label": variant.label,
         "mesh": {k: int(v) for k, v in mesh.shape.items()}}
    progress.status(f"{tag}: init")
    t0 = time.perf_counter()
    state = bts.make_state(variant, size, args, host_xy[0])
    shardings = state_shardings(state, mode, mesh)
    state = jax.block_until_ready(jax.device_put(state, shardings))
    x, y = jax.device_put(host_xy, NamedSharding(mesh, batch_spec(mesh)))
    r["init_s"] = time.perf_counter() - t0
    r["sharded_leaves"] = sum(not s.is_fully_replicated for s in jax.tree.leaves(shardings))
    progress.status(f"{tag}: compile")
    lowered, r["lower_s"] = bts.lower_step(variant, state, x, y,
                                           out_shardings=(shardings, NamedSharding(mesh, P())))
    compiled, r["compile_s"], part_text = compile_step(lowered, one_compile=args.smoke)
    del lowered
    text = compiled.as_text()
    r.update(inspect_programs(text, part_text, mesh, size))
    ops, kinds = hlo.op_families(text), kinds_by_kernel(text, r["collective_list"])
    del text, part_text

    def step(s):
        return compiled(s, x, y)  # noqa: F821 (bound above; deleted only at the end)

    progress.status(f"{tag}: timing")
    state, times, losses = common.time_steps(step, state, args)
    r.update(times)
    if args.trace_steps:
        progress.status(f"{tag}: tracing")
        state, figures = traced(lambda s: step(s)[0], state, args.trace_steps, ops, kinds)
        r.update(figures)
    r["steps_run"] = args.warmup + 2 * args.steps + args.trace_steps
    r["replicas"] = replica_check(state)
    r["loss_first"], r["loss_last"] = losses[0], losses[-1]
    r["loss_finite"] = all(math.isfinite(v) for v in losses)
    checks(variant, r, mesh, variant.recipe(args) if variant.recipe else None)
    del state, compiled
    return r


# --------------------------------------------------------------------------------------
# Derived numbers and the report.
# --------------------------------------------------------------------------------------

TIMES = (("device_ms", "device"), ("busy_ms", "busy"), ("pipelined_ms", "pipelined"),
         ("blocked_ms", "blocked"))


def derive(results):
    """Per mode and variant: speed-ups vs bf16 and vs Flax FP8 of every time, and the
    weight all-gathers' bytes over bf16's."""
    out = {}
    for mode, rows in common.by_group(results, "mode").items():
        per = common.speedups(rows, [metric for metric, _ in TIMES])
        wb = rows.get("bf16", {}).get("weight_all_gathers", {}).get("bytes")
        if wb:
            for v, r in rows.items():
                per[v]["weight_gather_bytes_over_bf16"] = r["weight_all_gathers"]["bytes"] / wb
        out[mode] = per
    return out


def fmt_bytes(n):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def fmt_collectives(summary):
    if not summary:
        return "none"
    return "; ".join(f"{op} ×{e['count']} ({', '.join(e['dtypes'])}, {fmt_bytes(e['bytes'])})"
                     for op, e in summary.items())


def fmt_gathers(g):
    if not g["count"]:
        return "none"
    return f"{g['count']}: " + ", ".join(f"{dt} {fmt_bytes(b)}" for dt, b in g["dtypes"].items())


def _mesh_text(mesh):
    return " × ".join(f"{k} {v}" for k, v in mesh.items())


def _mode_tables(rows, per):
    f = common.fmt
    lines = ["| variant | compile s | device ms | × bf16 | × Flax FP8 | busy ms | pipelined ms | "
             "× bf16 | × Flax FP8 | blocked ms | replicas identical |", "|---|" + "---:|" * 10]
    for r in rows:
        e = per.get(r["variant"], {})
        rep = r.get("replicas", {})
        lines.append("| " + " | ".join([
            r["label"], f(r.get("compile_s"), "{:.1f}"),
            f(r.get("device_ms"), "{:.3f}"), f(e.get("device_ms:vs_bf16"), "{:.3f}"),
            f(e.get("device_ms:vs_flax"), "{:.3f}"), f(r.get("busy_ms"), "{:.3f}"),
            f(r.get("pipelined_ms"), "{:.3f}"), f(e.get("pipelined_ms:vs_bf16"), "{:.3f}"),
            f(e.get("pipelined_ms:vs_flax"), "{:.3f}"), f(r.get("blocked_ms"), "{:.3f}"),
            ("yes" if rep.get("bit_identical") else "**NO**")
            + f" ({rep.get('replicated_leaves', 0)} leaves)"]) + " |")
    lines += ["", "| variant | compiled step's collectives | all-reduces by reduction | "
              "partitioned program's collectives | `maximum` all-reduces | `jax_fp8_update` | "
              "weight all-gathers, partitioned | bytes / bf16's | weight all-gathers, compiled |",
              "|---|---|---|---|---:|---:|---|---:|---|"]
    for r in rows:
        e = per.get(r["variant"], {})
        lines.append("| " + " | ".join([
            r["label"], fmt_collectives(r["collectives"]),
            ", ".join(f"{k} {v}" for k, v in r["all_reduce_kinds"].items()) or "none",
            fmt_collectives(r["partitioned_collectives"]),
            str(r["all_reduce_kinds"].get("maximum", 0)), str(r["hlo"]["jax_fp8_update"]),
            fmt_gathers(r["weight_all_gathers"]),
            f(e.get("weight_gather_bytes_over_bf16"), "{:.2f}"),
            fmt_gathers(r["weight_all_gathers_compiled"])]) + " |")
    kinds = list(dict.fromkeys(k for r in rows for k in r.get("collective_ms") or {}))
    if kinds:
        lines += ["", "| collective kernels, ms/step/device | "
                  + " | ".join(r["variant"] for r in rows) + " |", "|---|" + "---:|" * len(rows)]
        for k in kinds + ["total"]:
            cells = [f((r.get("collective_ms") or {}).get(k) if k != "total"
                       else r.get("collective_total_ms"), "{:.4f}", "0") for r in rows]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def markdown(data):
    meta, s = data["meta"], data["meta"]["settings"]
    lines = [f"# Multi-device train step: bf16 vs Flax FP8 vs jax_fp8 — "
             f"{meta['device_count']} × {meta['device']}", "",
             f"{s['layers']} blocks × 4 Dense, d = {s['d']}, {s['tokens']} tokens (global), "
             f"bf16 compute, f32 params, TrainState + optax.adam, state donated, amax "
             f"history {s['history_len']}, a/b/c in {s['groups']} groups; {s['warmup']} "
             f"warm-up steps, {s['steps']} timed, {s['trace_steps']} traced. jax "
             f"{meta['jax_version']}, flax {meta['flax_version']}, jax_fp8 "
             f"{meta['jax_fp8_version']}; git {meta['git_commit']}; {meta['date']}; "
             f"NCCL_NVLS_ENABLE={meta['nccl_nvls_enable']}.", "",
             "device: the kernels' summed durations per step, the mean over devices (CPU: "
             "XLA op time); busy: the union of their intervals (streams overlap); pipelined: "
             "wall time per step, steps dispatched back to back; blocked: median wall time "
             "of steps each followed by block_until_ready; × > 1 is faster; compile: XLA's "
             "compile of the sharded step; collectives as opcode ×count (dtypes, bytes of "
             "their results); partitioned: right after XLA's SPMD partitioner, before the "
             "backend's passes (XLA:CPU widens FP8 and bf16 collectives to f16/f32 later); "
             "weight all-gathers: of a parameter shard (through its quantization) into a whole "
             "kernel; collective kernels: the trace's, by kind (bench_multigpu.collective_kind)."]
    for mode, per in data["derived"].items():
        rows = [r for r in data["results"] if r["mode"] == mode]
        lines += ["", f"## {mode}: mesh {_mesh_text(rows[0]['mesh'])}", ""]
        lines += _mode_tables(rows, per)
        for r in rows:
            for err in r.get("check_errors", []):
                lines.append(f"\nCHECK FAILED {mode} {r['variant']}: {err}")
    lines += common.skipped_and_failed(data, "mode")
    lines += ["", common.command_line(meta)]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------

def _meshes(text):
    out = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        m = re.fullmatch(r"(dp|fsdp|tp)=(\d+(?:x\d+)?)", item)
        if not m:
            raise argparse.ArgumentTypeError(f"--mesh: MODE=SHAPE items, e.g. fsdp=2x4,tp=4x2; "
                                             f"got {item!r}")
        out[m.group(1)] = tuple(int(v) for v in m.group(2).split("x"))
    return out


def build_parser():
    p = common.arg_parser("bf16, Flax FP8 and jax_fp8 train steps, data-parallel, FSDP and "
                          "tensor-parallel, on every local device (bench/README.md).", __doc__)
    p.add_argument("--modes", type=common.subset_of(MODES, "--modes"), default=list(MODES),
                   help="comma-separated subset of dp,fsdp,tp (default: all)")
    p.add_argument("--variants", type=common.subset_of(tuple(bts.VARIANTS), "--variants"),
                   default=list(DEFAULT_VARIANTS),
                   help="bench_train_step.py's variants (default: "
                        + ",".join(DEFAULT_VARIANTS) + ")")
    p.add_argument("--layers", type=int, default=8, help="blocks of 4 Dense (8)")
    p.add_argument("--d", type=int, default=2048, help="model width (2048)")
    p.add_argument("--tokens", type=int, default=16384,
                   help="global tokens per step, split over the batch axes (16384)")
    p.add_argument("--mesh", type=_meshes, default={},
                   help="MODE=SHAPE,...: e.g. dp=8,fsdp=2x4,tp=4x2 (default per mode: dp and "
                        "fsdp all devices on one axis, tp 1x2 / 2x2 / 2x4 on 2 / 4 / 8 "
                        "devices); fewer devices than present use the first ones")
    p.add_argument("--steps", type=int, default=10, help="timed steps, blocked and pipelined (10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (3)")
    p.add_argument("--trace-steps", type=int, default=5, help="steps in the profiler trace (5)")
    p.add_argument("--history-len", type=int, default=1024,
                   help="amax history length, Flax and jax_fp8 alike (1024)")
    p.add_argument("--lr", type=float, default=1e-4, help="adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes for CPU: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                          for k, v in SMOKE.items())
                        + " (flags given win); one compile per step, the partitioned "
                          "program dumped by the timed one")
    p.add_argument("--outdir", default=os.path.join("out", "bench_multigpu"),
                   help="results.json, results.md (default out/bench_multigpu)")
    return p


def finalize(args, argv):
    if args.smoke:
        for name, value in SMOKE.items():
            if f"--{name.replace('_', '-')}" not in argv:
                setattr(args, name, value)
    if args.steps < 1 or args.trace_steps < 0 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1, --warmup and --trace-steps >= 0")
    n = jax.device_count()
    if n < 2:
        raise SystemExit(f"{n} device: the bench needs 2 or more (host CPUs: XLA_FLAGS="
                         "--xla_force_host_platform_device_count=N)")
    args.meshes = {m: args.mesh.get(m) or default_mesh(m, n) for m in MODES}
    # Block's groups: the tp mesh's model axis, in every mode (one model throughout).
    args.groups = args.meshes["tp"][1] if len(args.meshes["tp"]) == 2 else 1
    problems = []
    for mode in args.modes:
        shape = args.meshes[mode]
        names = axis_names(mode, shape)
        if not 2 <= math.prod(shape) <= n:
            problems.append(f"{mode}: a mesh of {'x'.join(map(str, shape))} devices, "
                            f"{n} present (2 to {n})")
        batch = math.prod(v for a, v in zip(names, shape) if a != "model")
        if args.tokens % batch:
            problems.append(f"{mode}: --tokens {args.tokens} not a multiple of {batch}")
        if mode == "fsdp" and args.d % shape[-1]:
            problems.append(f"fsdp: --d {args.d} not a multiple of {shape[-1]}")
    if args.d % args.groups:
        problems.append(f"--d {args.d} not a multiple of the tp model axis {args.groups}")
    if problems:
        raise SystemExit("; ".join(problems))
    return args


def run(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = finalize(build_parser().parse_args(argv), argv)
    os.makedirs(args.outdir, exist_ok=True)
    meta = common.environment(__file__, argv)
    meta.update(flax_version=flax.__version__, optax_version=optax.__version__,
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                settings={"modes": args.modes, "variants": args.variants,
                          "meshes": {m: list(args.meshes[m]) for m in args.modes},
                          "layers": args.layers, "d": args.d, "tokens": args.tokens,
                          "groups": args.groups, "steps": args.steps, "warmup": args.warmup,
                          "trace_steps": args.trace_steps, "history_len": args.history_len,
                          "lr": args.lr, "smoke": args.smoke})
    rng = np.random.default_rng(args.seed)   # the same data for every mode and variant
    host_xy = tuple(jnp.asarray(rng.standard_normal((args.tokens, args.d), np.float32),
                                jnp.bfloat16) for _ in range(2))
    plan = [(m, bts.VARIANTS[v]) for m in args.modes for v in args.variants]
    runs = common.Runs(meta, args.outdir, derive, markdown, time.perf_counter())
    with common.Progress(len(plan), "multi-device train step") as progress:
        progress.log(f"multi-device train step: {meta['device_count']} × {meta['device']} "
                     f"({meta['platform']}), jax {meta['jax_version']}, meshes "
                     f"{meta['settings']['meshes']}, variants {args.variants}")
        for mode, v in plan:
            runs.measure({"mode": mode, "variant": v.name},
                         functools.partial(measure_checked, mode, v, args, host_xy, progress),
                         _summary, progress)
    data = runs.finish()
    common.print_report(data, args.outdir)
    return data


def measure_checked(mode, variant, args, host_xy, progress):
    """(result row, the errors of its checks) of one variant in one mode."""
    r = measure(mode, make_mesh(mode, args.meshes[mode]), variant, args, host_xy, progress)
    return r, r.get("check_errors", [])


def _summary(r):
    """The progress line's phrases for one result row."""
    parts = [f"compile {r['compile_s']:.1f} s"] + common.times_text(r, TIMES)
    parts.append(f"max all-reduces {r['all_reduce_kinds'].get('maximum', 0)}")
    parts.append("replicas identical" if r["replicas"]["bit_identical"] else "REPLICAS DIFFER")
    parts += [f"CHECK FAILED: {e}" for e in r.get("check_errors", [])]
    return parts


def main(argv=None):
    return 1 if run(argv)["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
