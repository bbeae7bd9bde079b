"""What the benchmark scripts share: progress display, what-ran-where metadata, output files,
the run of a plan item by item (`Runs`) and the speed-ups and report lines derived from it.

Imported as a sibling module by the scripts in this directory (``python bench/<script>.py``
puts bench/ on the import path).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

try:
    from tqdm import tqdm
except ImportError:  # the plain one-line-per-update display below is used instead
    tqdm = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Progress:
    """A progress bar on a terminal (tqdm); elsewhere (a log file, CI) one line per step.

    ``log`` prints a message line (above the bar), ``status`` says what runs now (on the
    bar only), ``advance`` counts one unit of work done and prints what it gave. Nothing
    rewrites a line unless stderr is a terminal, so a log never holds carriage returns.
    """

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"
                                       "{postfix}")

    def log(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def status(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def advance(self, result: str) -> None:
        self.done += 1
        line = (f"[{self.done}/{self.total}] {result} "
                f"({time.perf_counter() - self.t0:.0f} s elapsed)")
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def platform_name() -> str:
    """"gpu", "cpu" or "tpu": the platform of jax's default device."""
    import jax
    p = jax.devices()[0].platform.lower()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def _git_commit():
    # A copy of the sources without their git history (e.g. sent to a GPU machine) can
    # name its commit: JAX_FP8_SOURCE_COMMIT=<hash>.
    if os.environ.get("JAX_FP8_SOURCE_COMMIT"):
        return os.environ["JAX_FP8_SOURCE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "ffi", "bench"],
                               cwd=ROOT, capture_output=True, timeout=30).returncode == 1
        return (f"{head}+dirty" if dirty else head) or None
    except Exception:  # noqa: BLE001 - not a git checkout, or no git
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fp:
            for line in fp:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_info(script: str, argv) -> dict:
    """What ran, with no jax backend started: Python, host, commit, date and the command
    line (a process that leaves the device to its workers can call it)."""
    return {
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {_cpu_model()}, "
                   f"{os.cpu_count()} CPU cores",
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": shlex.join(["python", os.path.relpath(os.path.abspath(script))]
                              + list(argv)),
    }


def environment(script: str, argv) -> dict:
    """What ran where: device, versions, host, commit, date and the command line."""
    import jax
    import jaxlib

    import jax_fp8
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": platform_name(),
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jaxlib, "__version__", None),
        "jax_fp8_version": getattr(jax_fp8, "__version__", None),
        "has_cpu_kernel": bool(jax_fp8.HAS_CPU_KERNEL),
        "has_cuda_kernel": bool(jax_fp8.HAS_CUDA_KERNEL),
        **run_info(script, argv),
    }


def _json_default(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x) if math.isfinite(float(x)) else None
    return str(x)


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fp:
        fp.write(text)
    os.replace(tmp, path)


def write_json(path: str, data) -> None:
    write_text(path, json.dumps(data, indent=1, default=_json_default) + "\n")


def write_outputs(outdir: str, data: dict) -> None:
    """OUTDIR/results.json and OUTDIR/results.md (``data["report_markdown"]``, headed by a
    note while ``data["partial"]``: the run has not finished)."""
    write_json(os.path.join(outdir, "results.json"), data)
    md = data["report_markdown"]
    if data.get("partial"):
        md = "(partial results: the run had not finished)\n\n" + md
    write_text(os.path.join(outdir, "results.md"), md + "\n")


def arg_parser(description: str, doc: str) -> argparse.ArgumentParser:
    """A script's parser: ``description``, and the script's docstring ``doc`` from its
    "Examples:" on as the help's epilog (its line breaks kept)."""
    return argparse.ArgumentParser(description=description, epilog=doc[doc.index("Examples:"):],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def fmt(x, spec: str = "{:.2f}", missing: str = "—") -> str:
    return missing if x is None else spec.format(x)


def fmt_us(us) -> str:
    """12.3 -> '12.3 µs', 4500 -> '4.50 ms'."""
    if us is None:
        return "n/a"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.0f} µs" if us >= 100 else f"{us:.1f} µs" if us >= 10 else f"{us:.2f} µs"


def fmt_ratio(x) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.1f}×" if x >= 10 else f"{x:.2f}×"


def save_plot(kind: str, data: dict, png: str, log) -> None:
    """Draws ``data`` with plot.py's ``kind`` plotter into ``png``; without matplotlib,
    says so and how to draw it later."""
    try:
        import plot
        getattr(plot, kind)(data, png)
        log(f"wrote {png}")
    except ImportError as err:
        log(f"no plot ({err}); draw it where matplotlib is: python bench/plot.py "
            f"{os.path.join(os.path.dirname(png), 'results.json')} --png {png}")


# --------------------------------------------------------------------------------------
# A plan of variants run item by item (bench_train_step.py, bench_multigpu.py).
# --------------------------------------------------------------------------------------

class RecipeNotAccepted(Exception):
    """This jax_fp8 does not take the variant's recipe (yet): the variant is skipped."""


class Runs:
    """The rows a plan's items gave, its failures and its skipped items, and the outputs.

    ``derive(results)`` -> the "derived" entry of results.json, ``markdown(data)`` -> the
    report; OUTDIR/results.json and results.md are rewritten after every item (partial until
    ``finish``), so an interrupted run keeps what it measured. ``t0``: the run's start
    (perf_counter), from which meta["total_s"] counts."""

    def __init__(self, meta, outdir, derive, markdown, t0):
        self.meta, self.outdir, self.t0 = meta, outdir, t0
        self.derive, self.markdown = derive, markdown
        self.results, self.failures, self.skipped = [], [], []

    def measure(self, where, measure, summary, progress):
        """One item: ``measure()`` -> (row, the errors of its checks), ``where`` (e.g.
        {"size": ..., "variant": ...}) naming it in failures and skipped and, its values
        joined, in the progress line, with ``summary(row)`` (a list of phrases). A variant
        whose recipe is not accepted is skipped; any other error is a failure, and the
        other items still run."""
        t0, done = time.perf_counter(), " ".join(where.values()) + ": "
        try:
            row, errors = measure()
            self.results.append(row)
            self.failures += [{**where, "error": e} for e in errors]
            done += ", ".join(summary(row)) + f"; took {time.perf_counter() - t0:.0f} s"
        except RecipeNotAccepted as err:
            self.skipped.append({**where, "reason": str(err)})
            done += f"skipped: {err}"
        except Exception as err:  # noqa: BLE001 - the other items still run
            traceback.print_exc(file=sys.stderr)
            self.failures.append({**where, "error": f"{type(err).__name__}: {err}"})
            done += f"FAILED: {type(err).__name__}: {err}"
        gc.collect()
        progress.advance(done)
        self.meta["total_s"] = round(time.perf_counter() - self.t0, 1)
        self.write(partial=True)

    def data(self, partial):
        """results.json's content: meta, results, derived, failures, skipped, partial and
        the markdown report."""
        data = {"meta": self.meta, "results": self.results, "derived": self.derive(self.results),
                "failures": self.failures, "skipped": self.skipped, "partial": partial}
        data["report_markdown"] = self.markdown(data)
        return data

    def write(self, partial):
        data = self.data(partial)
        write_outputs(self.outdir, data)
        return data

    def finish(self):
        """The final (not partial) outputs, written; returns their data."""
        return self.write(partial=False)


def print_report(data, outdir):
    """The markdown report to stdout, where the files went to stderr."""
    print(data["report_markdown"])
    print(f"wrote {os.path.join(outdir, 'results.json')} and results.md", file=sys.stderr)


def by_group(results, group):
    """{value of ``group`` (e.g. "size"): {variant: row}}, in the order of the results."""
    out = {}
    for r in results:
        out.setdefault(r[group], {})[r["variant"]] = r
    return out


def speedups(rows, metrics):
    """{variant: {"<metric>:vs_bf16": bf16's time / the variant's, "<metric>:vs_flax": Flax
    FP8's / the variant's}} of one group's ``rows`` ({variant: row}; > 1 is faster), for
    every metric (a time) both rows have, non-zero."""
    base, flax_row = rows.get("bf16", {}), rows.get("flax_fp8", {})
    out = {}
    for v, r in rows.items():
        e = {}
        for metric in metrics:
            t = r.get(metric)
            if t:
                if base.get(metric):
                    e[f"{metric}:vs_bf16"] = base[metric] / t
                if flax_row.get(metric):
                    e[f"{metric}:vs_flax"] = flax_row[metric] / t
        out[v] = e
    return out


def times_text(r, times):
    """"device 1.234 ms", ... for each (key, name) of ``times`` the row ``r`` has."""
    return [f"{name} {r[key]:.3f} ms" for key, name in times if r.get(key) is not None]


def command_line(meta):
    """The report's last line: the command and its total time."""
    return f"Command: `{meta['command']}`; total {meta.get('total_s', '?')} s"


def skipped_and_failed(data, group):
    """The report's lines for the skipped and the failed items (``group``: the key naming
    an item besides its variant, e.g. "size"), each after a blank line."""
    lines = [f"\nSkipped {x[group]} {x['variant']}: {x['reason']}" for x in data["skipped"]]
    return lines + [f"\nFAILED {x[group]} {x['variant']}: {x['error']}" for x in data["failures"]]


def time_steps(step, state, args):
    """Runs ``state, loss = step(state)``: args.warmup steps, args.steps steps each followed
    by block_until_ready, args.steps steps back to back. Returns (state, times, losses):
    times has blocked_ms (the median), blocked_ms_all, dispatch_ms, pipelined_ms."""
    import jax
    losses, r = [], {}
    for _ in range(args.warmup):
        state, loss = step(state)
        losses.append(float(loss))
    times, dispatch = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, loss = step(state)
        dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    r["blocked_ms"] = statistics.median(times) * 1e3
    r["blocked_ms_all"] = [round(t * 1e3, 4) for t in times]
    r["dispatch_ms"] = statistics.median(dispatch) * 1e3
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, loss = step(state)
    jax.block_until_ready((state, loss))
    r["pipelined_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
    losses.append(float(loss))
    return state, r, losses


def subset_of(allowed, what):
    """An argparse ``type``: "all", or a comma-separated subset of ``allowed`` (in the order
    given); anything else is an ArgumentTypeError naming ``what``."""
    def parse(text):
        if text.strip() == "all":
            return list(allowed)
        out = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in out if t not in allowed]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"{what}: 'all' or a comma-separated subset of "
                                             f"{','.join(allowed)}; got {text!r}")
        return out
    return parse


# ------------------------------------------------------- mixture-of-experts benchmarks
# The MoE layers that bench_moe.py and bench_grouped_gemm.py measure, as (experts, top_k,
# d, expert ffn, tokens); each script adds its own CPU smoke model "tiny".
MOE_MODELS = {
    "qwen3_moe": (128, 8, 2048, 768, 4096),   # Qwen3-MoE-like
    "deepseek": (256, 8, 7168, 2048, 4096),   # DeepSeek-V3-like
}


def moe_args(doc: str, models, steps: int, outdir: str, argv=None, extra=None):
    """The command line of an MoE benchmark (the script's docstring ``doc`` gives its
    help): ``--models`` (names of ``models``, comma- or space-separated; default
    qwen3_moe and deepseek), ``--steps`` (default ``steps``), ``--outdir`` (default
    ``outdir``), and what ``extra(parser)`` adds. Returns the parsed arguments, ``models``
    a list; an unknown model is a usage error."""
    parser = arg_parser(doc.splitlines()[0], doc)
    parser.add_argument("--models", nargs="+", default=list(MOE_MODELS))
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--outdir", default=outdir)
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    args.models = [m for text in args.models for m in text.split(",") if m]
    unknown = sorted(set(args.models) - set(models))
    if unknown:
        parser.error(f"unknown models {unknown}: choose from {sorted(models)}")
    return args


def write_report(outdir: str, name: str, data, md: str, quiet: bool = False) -> None:
    """OUTDIR/NAME.json (``data``) and OUTDIR/NAME.md (the table ``md``), which is also
    printed unless ``quiet``."""
    md = md.rstrip("\n")
    write_json(os.path.join(outdir, name + ".json"), data)
    write_text(os.path.join(outdir, name + ".md"), md + "\n")
    if not quiet:
        print(md, flush=True)


def run_tiny(script: str, outdir, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT --models tiny --steps 2 --outdir OUTDIR`` on CPU from the
    repository root (a smoke run of an MoE benchmark); asserts that it exits 0."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join("bench", script), "--models", "tiny",
                           "--steps", "2", "--outdir", str(outdir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
