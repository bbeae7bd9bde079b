"""Where an XLA compile's time goes, read from XLA's own log: pass by pass, and in XLA:GPU's
autotuning.

A compile run with ``LOG_ENV`` in its environment logs, for every HLO pass, a line
``HLO pass: NAME time: ... (N us)`` (XLA's scoped timer in hlo_pass_pipeline.cc), and for
every pass pipeline it starts, ``Running HLO pass pipeline on module M: P`` (the same
file's VLOG(1)). On a GPU, XLA's autotuning pass compiles every candidate of every fusion
it tunes as a module of its own, on worker threads, and then runs the candidates on the
device, logging nothing; so the pass's time splits into the candidates' compilation (up
to the last line a worker thread logs inside the pass) and what follows it (the
candidates' runs, and applying the winners). At the autotuner's VLOG level 3 it also
logs every candidate's result; a candidate whose output disagrees with the others' is
logged with its count of disagreeing elements (`candidate_checks`): describing those
elements is host work that grows with their number.
"""

from __future__ import annotations

import dataclasses
import re

# TF_CPP_MIN_LOG_LEVEL=0: INFO lines reach stderr; the VMODULE level 1 turns on the timers.
# autotuner=3: each autotuning candidate's result.
LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "hlo_pass_pipeline=1,autotuner=3"}

# XLA:GPU's autotuning passes over the versions jax 0.10-0.11 ship ("config-assigner" is
# the autotuner of the newer ones); any pass named "*autotun*" counts too.
AUTOTUNE_PASSES = ("config-assigner", "gemm-fusion-autotuner", "gemm-algorithm-picker",
                   "autotuner")

_LINE = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?)\s+(\d+) ([^\]]+)\] (.*)$")
_PASS_TIME = re.compile(r"HLO pass: (\S+) time: .*?\((\d+) us\)")
_PASS_START = re.compile(r"^\s*HLO pass (\S+)$")
_PIPELINE = re.compile(r"Running HLO pass pipeline on module (\S+): (.+)$")
_CANDIDATE = re.compile(r"^\{([A-Z][A-Z0-9_]*) : ")
_MISMATCH = re.compile(r"Mismatch count: (\d+) / (\d+)")


@dataclasses.dataclass(frozen=True)
class Line:
    """One glog line: ``t`` seconds since the day began (kept increasing past midnight),
    the logging thread, ``where`` (file:line) and the message."""

    t: float
    thread: int
    where: str
    msg: str


def parse(text: str) -> list[Line]:
    """The glog lines of ``text`` (other lines, e.g. Python's, skipped)."""
    out, day = [], 0.0
    for raw in text.splitlines():
        m = _LINE.match(raw)
        if not m:
            continue
        t = int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]) + day
        if out and t < out[-1].t - 43200:   # the clock passed midnight
            day += 86400
            t += 86400
        out.append(Line(t, int(m[4]), m[5], m[6]))
    return out


def main_thread(lines: list[Line], module_prefix: str = "jit_") -> int | None:
    """The thread that runs the compiled program's own passes: the first to start a pass
    pipeline on a module whose name starts with ``module_prefix``."""
    for ln in lines:
        m = _PIPELINE.search(ln.msg)
        if m and m[1].startswith(module_prefix):
            return ln.thread
    return None


def pass_times(lines: list[Line], thread: int | None = None) -> dict[str, float]:
    """Seconds per pass name on ``thread`` (default: the main thread), slowest first: each
    run's own time, without the passes it ran inside it (so a pass pipeline counts only
    its overhead, its passes count for themselves), summed over the pass's runs."""
    thread = main_thread(lines) if thread is None else thread
    out: dict[str, float] = {}
    stack: list[list] = []    # [name, seconds of the passes run inside it]
    for ln in lines:
        if ln.thread != thread:
            continue
        m = _PASS_START.match(ln.msg)
        if m:
            stack.append([m[1], 0.0])
            continue
        m = _PASS_TIME.search(ln.msg)
        if not m:
            continue
        seconds = int(m[2]) / 1e6
        names = [name for name, _ in stack]
        if m[1] in names:      # (a start line missing for a pass above it: dropped)
            inner = stack[len(names) - 1 - names[::-1].index(m[1]):]
            del stack[len(stack) - len(inner):]
            seconds_inside = inner[0][1]
        else:
            seconds_inside = 0.0
        out[m[1]] = out.get(m[1], 0.0) + max(seconds - seconds_inside, 0.0)
        if stack:
            stack[-1][1] += seconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def is_autotuning(name: str) -> bool:
    return name in AUTOTUNE_PASSES or "autotun" in name


def autotuning(lines: list[Line], thread: int | None = None) -> dict | None:
    """XLA:GPU's autotuning on ``thread`` (default: the main thread), summed over its
    passes' runs: ``s`` (the passes' time), ``compile_s`` (from each run's start to the
    last line a worker thread logged in it: the candidates' compilation), ``after_s``
    (the rest: the candidates' runs on the device, applying the winners) and
    ``fusions`` (the modules the workers compiled: one per fusion tuned). None when no
    autotuning pass ran (e.g. on CPU)."""
    thread = main_thread(lines) if thread is None else thread
    runs = []
    for i, ln in enumerate(lines):
        m = _PASS_TIME.search(ln.msg) if ln.thread == thread else None
        if m and is_autotuning(m[1]):
            runs.append((m[1], ln.t - int(m[2]) / 1e6, ln.t, i))
    if not runs:
        return None
    out = {"passes": sorted({name for name, *_ in runs}), "s": 0.0, "compile_s": 0.0,
           "after_s": 0.0, "fusions": 0}
    start_index = 0
    for _name, t0, t1, end_index in runs:
        workers = [ln for ln in lines[start_index:end_index]
                   if ln.thread != thread and t0 <= ln.t <= t1]
        modules = {re.sub(r"_computation$", "", m[1]) for ln in workers
                   for m in [_PIPELINE.search(ln.msg)] if m}
        last = max((ln.t for ln in workers), default=t0)
        out["s"] += t1 - t0
        out["compile_s"] += last - t0
        out["after_s"] += t1 - last
        out["fusions"] += len(modules)
        start_index = end_index + 1
    return out


def candidate_checks(text: str) -> dict | None:
    """The autotuning candidates' results in ``text`` (logged at the autotuner's VLOG
    level 3): ``candidates`` (results logged, by backend), ``disagreeing`` (those logged
    as WRONG RESULTS: output unlike the winning cluster's) and ``disagreeing_elements``
    (their outputs' elements outside the tolerance, summed). None when none is logged."""
    backends: dict[str, int] = {}
    disagreeing = elements = 0
    current_wrong = False
    for raw in text.splitlines():
        m = _LINE.match(raw)
        if m:
            c = _CANDIDATE.match(m[6])
            current_wrong = bool(c) and "WRONG RESULTS" in m[6]
            if c:
                backends[c[1]] = backends.get(c[1], 0) + 1
                disagreeing += current_wrong
            continue
        mm = _MISMATCH.search(raw) if current_wrong else None
        if mm:
            elements += int(mm[1])
            current_wrong = False   # (one count per candidate)
    if not backends:
        return None
    return {"candidates": dict(sorted(backends.items())), "disagreeing": disagreeing,
            "disagreeing_elements": elements}


def summary(text: str, top: int = 8) -> dict:
    """{"passes": the ``top`` slowest passes as [name, s], "pass_s": all passes' time,
    "autotune": `autotuning` or None, "candidate_checks": `candidate_checks` or None} of
    one compile's log."""
    lines = parse(text)
    times = pass_times(lines)
    return {"passes": [[k, round(v, 3)] for k, v in list(times.items())[:top]],
            "pass_s": round(sum(times.values()), 3), "autotune": autotuning(lines),
            "candidate_checks": candidate_checks(text)}
