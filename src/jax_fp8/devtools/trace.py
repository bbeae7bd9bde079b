"""Profiler traces: capture one, keep the device's kernel events, sum them by name or family.

A trace is the list of Chrome/Perfetto trace events that ``jax.profiler`` writes as
``**/*perfetto_trace.json.gz`` (``create_perfetto_trace=True``). On a GPU the device's
work is the complete events (``ph == "X"``) of the processes named ``/device:GPU:N``:
one per kernel or memcpy, with its duration ``dur`` in µs. A CPU run has no events in a
device process; there the XLA runtime's op events (those with an ``hlo_op`` argument)
stand in, so the same code measures time spent inside XLA ops. Example::

    state, events = trace.capture(step, state, steps=5)
    kernels = trace.device_events(events)
    trace.total_us(kernels) / 5              # device time per step
    trace.by_family(kernels)                 # {'gemm': 31e3, 'loop fusion': 9e3, ...}
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from jax_fp8 import _registration
from jax_fp8.devtools.hlo import kernel_name

__all__ = ["by_family", "by_name", "capture", "device_events", "kernel_family", "load",
           "per_run_us", "total_us"]

Event = dict[str, Any]

# Timelines a profiler may add to a device process, derived from the kernels (counting
# them would count every kernel twice).
_DERIVED = re.compile(r"XLA Ops|XLA Modules|XLA TraceMe|Framework|TensorFlow|Steps|Source|"
                      r"Launch Stats|Name Scope|Async XLA Ops", re.IGNORECASE)
_DEVICE = re.compile(r"/device:(GPU|TPU)")
# jax_fp8's CUDA kernels -> their custom-call targets (ffi/module.cc's table).
_OWN_KERNELS = {t.cuda_kernel: t.name for t in _registration.TARGETS.values()}
_FAMILY_RULES = (
    ("gemm", re.compile(r"nvjet|cublas|cutlass|xmma|gemm|matmul|^dot[._\d]|^dot$", re.I)),
    ("collective", re.compile(r"nccl|all.?reduce|all.?gather|reduce.?scatter|all.?to.?all|"
                              r"collective.?permute", re.I)),
    ("copy", re.compile(r"memcpy|memset|^copy", re.I)),
)
_FUSION = re.compile(r"^(loop|input|wrapped|triton|concatenate|reduction|transpose|scatter|"
                     r"dynamic_update_slice)_")


def load(logdir: str) -> list[Event]:
    """The events of the newest ``*perfetto_trace.json.gz`` under ``logdir`` (searched
    recursively, as ``jax.profiler`` nests it under ``plugins/profile/<run>/``)."""
    files = sorted(glob.glob(os.path.join(logdir, "**", "*perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *perfetto_trace.json.gz under {logdir}")
    with gzip.open(files[-1], "rb") as fp:
        data = json.load(fp)
    return cast("list[Event]", data["traceEvents"] if isinstance(data, dict) else data)


def _start(logdir: str) -> None:
    import jax
    try:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0  # no Python events: smaller traces, less overhead
        jax.profiler.start_trace(logdir, create_perfetto_trace=True, profiler_options=opts)
    except (AttributeError, TypeError):  # a jax without ProfileOptions
        jax.profiler.start_trace(logdir, create_perfetto_trace=True)


def capture(step: Callable[[Any], Any], carry: Any, steps: int = 1,
            logdir: str | None = None) -> tuple[Any, list[Event]]:
    """Runs ``carry = step(carry)`` ``steps`` times under the profiler; returns
    ``(carry, events)``.

    ``carry`` is threaded through the calls, so a step that donates its input works.
    Everything is waited for before the trace stops. ``logdir``: keep the trace there
    (default: a temporary directory, removed afterwards).
    """
    import jax
    tmp = logdir is None
    logdir = tempfile.mkdtemp(prefix="jax_fp8_trace_") if logdir is None else logdir
    try:
        # jax.block_until_ready and jax.profiler.stop_trace are unannotated in JAX.
        jax.block_until_ready(carry)  # type: ignore[no-untyped-call]
        _start(logdir)
        try:
            for _ in range(steps):
                carry = step(carry)
            jax.block_until_ready(carry)  # type: ignore[no-untyped-call]
        finally:
            jax.profiler.stop_trace()  # type: ignore[no-untyped-call]
        return carry, load(logdir)
    finally:
        if tmp:
            shutil.rmtree(logdir, ignore_errors=True)


def _names(events: Iterable[Event]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M":
            name = str((e.get("args") or {}).get("name", ""))
            if e.get("name") == "process_name":
                procs[e.get("pid")] = name
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = name
    return procs, threads


def device_events(events: list[Event], platform: str | None = None) -> list[Event]:
    """The device's work: complete events of the ``/device:GPU`` processes (their derived
    "XLA Ops"-like timelines left out) or, on CPU, the XLA op events.

    platform: ``"gpu"`` or ``"cpu"``; None picks GPU when a device process has events.
    """
    procs, threads = _names(events)
    # A jax with a CUDA plugin names a /device:GPU:0 process in every trace, a CPU run's
    # too (JAX_PLATFORMS=cpu, or a program on the CPU device); only its events tell.
    pids = {e.get("pid") for e in events if e.get("ph") == "X"
            and _DEVICE.search(procs.get(e.get("pid"), ""))}
    if platform is None:
        platform = "gpu" if pids else "cpu"
    if platform != "cpu":
        derived = {k for k, name in threads.items() if k[0] in pids and _DERIVED.search(name)}
        return [e for e in events if e.get("ph") == "X" and e.get("pid") in pids
                and (e.get("pid"), e.get("tid")) not in derived]
    return [e for e in events if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})
            and not str(e.get("name", "")).startswith("end: ")]


def total_us(events: Iterable[Event]) -> float:
    """Sum of the complete events' durations, in µs."""
    return float(sum(float(e.get("dur", 0.0)) for e in events if e.get("ph", "X") == "X"))


def by_name(events: Iterable[Event]) -> dict[str, tuple[int, float]]:
    """``{kernel name: (count, total µs)}``, the largest total first."""
    acc: dict[str, list[Any]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        slot = acc[str(e.get("name", "?"))]
        slot[0] += 1
        slot[1] += float(e.get("dur", 0.0))
    return {k: (n, us) for k, (n, us) in sorted(acc.items(), key=lambda kv: -kv[1][1])}


def per_run_us(events: Iterable[Event]) -> list[float] | None:
    """Device time of each execution, where the events carry XLA's ``run_id`` (the CPU
    runtime's do), in the order run; None when some event has none."""
    runs: dict[str, float] = {}
    for e in events:
        run = (e.get("args") or {}).get("run_id")
        if run is None:
            return None
        runs[run] = runs.get(run, 0.0) + float(e.get("dur", 0.0))
    return list(runs.values())


def kernel_family(name: str, ops: Mapping[str, str] | None = None) -> str:
    """The family of a kernel (GPU) or op (CPU) name.

    ``ops`` (`hlo.op_families` of the traced program) decides where it knows the name:
    ``"fp8 gemm"``, ``"gemm"``, ``"custom-call:<target>"``, ``"collective:<opcode>"``.
    Otherwise by name: ``nvjet_sm90_qqtst_...`` -> ``"gemm"``; ``ncclDevKernel_...`` ->
    ``"collective"``; ``loop_add_fusion_3`` -> ``"loop fusion"``; ``input_reduce_fusion``
    -> ``"input fusion"``; jax_fp8's ``UpdateKernel`` -> ``"custom-call:jax_fp8_update"``;
    ``memcpy32_post`` -> ``"copy"``; else ``"fusion"`` or ``"other"``.
    """
    if ops:
        family = ops.get(kernel_name(name))
        if family:
            return family
    for kernel, target in _OWN_KERNELS.items():
        if kernel in name:
            return f"custom-call:{target}"
    stem = re.sub(r"(?:[._]\d+)+$", "", name)
    if stem.startswith("jax_fp8_"):
        return f"custom-call:{stem}"
    for family, pattern in _FAMILY_RULES:
        if pattern.search(name):
            return family
    m = _FUSION.match(name)
    if m:
        return f"{m.group(1).replace('_', ' ')} fusion"
    return "fusion" if "fusion" in name else "other"


def by_family(events: Iterable[Event], ops: Mapping[str, str] | None = None) -> dict[str, float]:
    """``{family: total µs}`` (`kernel_family`), the largest first. An event's ``hlo_op``
    argument, where the trace has one, is looked up in ``ops`` before its name."""
    acc: dict[str, float] = collections.defaultdict(float)
    for e in events:
        hlo_op = (e.get("args") or {}).get("hlo_op")
        family = ops.get(kernel_name(str(hlo_op))) if ops and hlo_op else None
        acc[family or kernel_family(str(e.get("name", "?")), ops)] += float(e.get("dur", 0.0))
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))
