"""Where an FP8 GEMM is faster than the same GEMM in bf16: the decision behind `Fp8Rule`'s
default (``min_fp8_flops="measured"``).

FP8 pays only where the faster GEMMs save more than the quantization, amaxes and transposes
around them cost, and that depends on all three sizes of the GEMM, not its FLOPs alone (a
projection onto 256 outputs loses at any token count; one onto 4096 wins from ~1024
inputs). So the decision reads a table measured on the GPU: bf16 device time over FP8 device
time of one dense layer's forward and backward (``x [M, K] . w [K, N]``: three GEMMs with the
recipe's quantization) on a grid of (M, K, N), per recipe, per GPU architecture
(``tables/gemm_speedup_<arch>.json``, each with the command, commit and date that made it:
``bench/bench_dense.py``). A GEMM converts where the speedup interpolated at its sizes (in
log2 of each size; past the grid's largest sizes the largest's, which only understates a
larger GEMM's gain) is at least `MARGIN`; below the grid's smallest sizes nothing was
measured and the GEMM stays as it is.

Where no table exists:

* a CUDA GPU of another architecture: the conservative rule `conservative` (the recipe's
  ``auto_min_fp8_flops`` forward FLOPs, M >= 2048 and K, N >= 1024);
* the CPU: every GEMM converts. FP8 is emulated there (no FP8 GEMM is faster), and the CPU
  runs FP8 programs to check their numbers, not their speed.

The platform is the default backend when the GEMM is traced (``jax.default_backend()``), and
its GPU the first of its devices; inside ``with deciding_for("sm_90"):`` the decisions are
those of that architecture wherever the program is traced (a model built on a CPU, checked
for the GPU it will train on, e.g. with ``jax_fp8.devtools.explain``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import json
import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import jax

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["MARGIN", "MEASURED", "conservative", "decide", "decide_on", "deciding_for",
           "speedup", "table_for"]

MEASURED = "measured"
# The interpolated speedup a GEMM needs to convert: above the run-to-run spread of the
# measurements (a few percent), and the per-tensor state update the GEMM adds to the step.
MARGIN = 1.05


@functools.cache
def table_for(arch: str) -> dict[str, Any] | None:
    """The measured table of a GPU architecture ("sm_90"), or None."""
    name = f"gemm_speedup_{arch.replace('_', '')}.json"
    resource = importlib.resources.files("jax_fp8") / "tables" / name
    if not resource.is_file():
        return None
    return cast("dict[str, Any]", json.loads(resource.read_text()))


def _arch(device: Any) -> str | None:
    cap = str(getattr(device, "compute_capability", "") or "")
    if not cap:
        return None
    major, _, minor = cap.partition(".")
    return f"sm_{major}{minor or '0'}"


def _axis(grid: Sequence[float], value: float) -> tuple[int, float] | None:
    """(i, weight of grid[i + 1]) of log2(value) on the log2 grid; None below it."""
    if value < grid[0]:
        return None
    x = math.log2(value)
    pts = [math.log2(g) for g in grid]
    if x >= pts[-1]:
        return len(grid) - 2, 1.0
    i = max(j for j in range(len(grid) - 1) if pts[j] <= x)
    return i, (x - pts[i]) / (pts[i + 1] - pts[i])


def speedup(table: dict[str, Any], recipe: Any, m: int, k: int, n: int) -> float | None:
    """The speedup `table` gives a GEMM [m, k] . [k, n] in `recipe`, interpolated in log2 of
    each size (the largest sizes' past the grid); None below the grid or for a recipe the
    table does not measure."""
    values = table["speedup"].get(type(recipe).__name__)
    if values is None:
        return None
    axes = [_axis(table["m"], m), _axis(table["k"], k), _axis(table["n"], n)]
    if any(a is None for a in axes):
        return None
    total = 0.0
    for corner in range(8):
        w, v = 1.0, values
        for bit, axis in enumerate(axes):
            i, t = cast("tuple[int, float]", axis)  # not None: checked above
            hi = (corner >> bit) & 1
            w *= t if hi else 1 - t
            v = v[i + hi]
        total += w * v
    return total


def conservative(recipe: Any, m: int, k: int, n: int) -> bool:
    """The rule where no table exists for a GPU: the recipe's ``auto_min_fp8_flops``
    forward FLOPs, at least 2048 rows and 1024 inputs and outputs."""
    return 2 * m * k * n >= recipe.auto_min_fp8_flops and m >= 2048 and min(k, n) >= 1024


_local = threading.local()


@contextlib.contextmanager
def deciding_for(arch: str) -> Iterator[None]:
    """Inside it, `decide` decides as on a GPU of architecture ``arch`` ("sm_90"), whatever
    the platform the program is traced on. It applies to what is traced inside it: a
    function ``jax.jit`` traced before keeps the decisions of its trace."""
    if not isinstance(arch, str) or not arch.startswith("sm_"):
        raise ValueError(f"deciding_for: arch must be a GPU architecture such as 'sm_90', got "
                         f"{arch!r}")
    previous = getattr(_local, "arch", None)
    _local.arch = arch
    try:
        yield
    finally:
        _local.arch = previous


def decide(recipe: Any, m: int, k: int, n: int) -> tuple[bool, str]:
    """(whether the GEMM [m, k] . [k, n] (m: all rows, batch included) converts to FP8 in
    `recipe` on the platform it is traced for, why in words)."""
    arch = getattr(_local, "arch", None)
    if arch is None:
        if jax.default_backend() == "cpu":
            return True, "the CPU: FP8 is emulated there, every GEMM converts (its numbers)"
        arch = _arch(jax.devices()[0]) or jax.default_backend()
    return decide_on(arch, recipe, m, k, n)


def decide_on(arch: str, recipe: Any, m: int, k: int, n: int) -> tuple[bool, str]:
    """`decide` on a GPU of architecture ``arch``: its table, else the conservative rule."""
    table = table_for(arch) if arch.startswith("sm_") else None
    if table is None:
        ok = conservative(recipe, m, k, n)
        return ok, (f"no measured table for {arch}: the conservative rule "
                    f"(>= {recipe.auto_min_fp8_flops:.3g} FLOPs, M >= 2048, K, N >= 1024) "
                    f"{'holds' if ok else 'does not hold'}")
    s = speedup(table, recipe, m, k, n)
    where = f"{table['device']} ({arch}), M, K, N = {m}, {k}, {n}"
    if s is None:
        if type(recipe).__name__ not in table["speedup"]:
            return False, f"{type(recipe).__name__} is not faster than bf16 on {where}"
        return False, (f"smaller than every GEMM measured on {where} (M >= {table['m'][0]}, "
                       f"K, N >= {table['k'][0]})")
    ok = s >= MARGIN
    return ok, f"FP8 measured {s:.2f}x bf16 on {where} ({'>=' if ok else '<'} {MARGIN})"
