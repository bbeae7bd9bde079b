"""What the benchmark scripts share: progress display, what-ran-where metadata, output files.

Imported as a sibling module by the scripts in this directory (``python bench/<script>.py``
puts bench/ on the import path).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time

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
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {_cpu_model()}, "
                   f"{os.cpu_count()} CPU cores",
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": shlex.join(["python", os.path.relpath(os.path.abspath(script))]
                              + list(argv)),
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
