"""The report of a converting call: matched modules that run no GEMM in FP8.

`reporting` spans one converting call (the arrays it follows to parameters live for
it); `note` records, per module, whether a GEMM ran in FP8 or was kept and why; at the
end every matched module that ran none in FP8 is warned about once, as an
`Fp8ConversionWarning` pointing at the user's call, and the GEMMs kept because FP8 is not
faster at their sizes (``min_fp8_flops="measured"``, `MEASURED`) in one warning per model.
Part of `jax_fp8.interception`, which re-exports its public names.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jax_fp8.interception._follow import local
from jax_fp8.rules import Fp8ConversionWarning

if TYPE_CHECKING:
    from jax_fp8.interception._site import Site

_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_warned: set[tuple[Any, ...]] = set()  # (owner, path, reason) already reported in this process
# The reason of a GEMM kept because FP8 is not faster at its sizes (dot_general's
# MEASURED_SCOPE): reported for the whole model at once.
MEASURED = "fp8_not_faster"


@contextlib.contextmanager
def reporting(owner: Any, label: str) -> Iterator[None]:
    """The report of one converting call (for nested calls, the outermost's): the arrays
    followed to parameters (`track`) live for it, and at its end every module that a
    rule matched and that ran no GEMM in FP8 is reported, once per ``owner`` (the
    converted model or class), module path and reason, as an `Fp8ConversionWarning`
    naming ``label`` (the model)."""
    if getattr(local, "report", None) is not None:
        yield
        return
    local.report, local.tracked = {}, {}
    try:
        yield
    except BaseException:
        local.report = local.tracked = None
        raise
    report, local.report, local.tracked = local.report, None, None
    for path, entry in report.items():
        if not entry["fp8"]:
            for reason, text in entry["reasons"].items():
                if reason != MEASURED:
                    _warn(owner, label, path, entry, reason, text)
    _warn_measured(owner, label, report)


def note(site: Site, reason: str | None, text: str = "") -> None:
    """Records for the report that a GEMM of ``site``'s module ran in FP8 (``reason``
    None) or was kept, for ``reason`` (a `KEPT_SCOPES` key or ``KEPT_SCOPE``) explained by
    ``text``. Outside `reporting` a kept GEMM is reported at once."""
    if site.path is None:
        return
    report = getattr(local, "report", None)
    entry: dict[str, Any] = {"type": site.module_type, "rule": site.rule, "fp8": False,
                             "reasons": {}, "where": site.where}
    if report is not None:
        entry = report.setdefault(site.path, entry)
    if reason is None:
        entry["fp8"] = True
    elif reason not in entry["reasons"]:
        entry["reasons"][reason] = text
        if report is None:
            _warn(site.rule, "the model", site.path, entry, reason, text)


def _warn_measured(owner: Any, label: str, report: dict[str, dict[str, Any]]) -> None:
    """One warning for the model: its modules whose GEMMs stay out of FP8 because FP8 is
    not faster at their sizes on this platform."""
    kept = {path: e["reasons"][MEASURED] for path, e in report.items() if MEASURED in e["reasons"]}
    if not kept:
        return
    with _lock:
        if (owner, MEASURED) in _warned:
            return
        _warned.add((owner, MEASURED))
    none_fp8 = not any(e["fp8"] for e in report.values())
    head = ("the model is too small to gain from FP8 on this platform: none of its GEMMs "
            "converts" if none_fp8 else
            f"{len(kept)} of its {len(report)} matched modules keep GEMMs out of FP8, which is "
            f"not faster at their sizes on this platform")
    shown = "; ".join(f"{report[p].get('where') or p or 'the root module'!r}: {t}"
                      for p, t in list(kept.items())[:4])
    more = f"; and {len(kept) - 4} more" if len(kept) > 4 else ""
    warnings.warn(f"jax_fp8 fp8_model({label}): {head} ({shown}{more}). "
                  f"`jax_fp8.devtools.explain` lists every GEMM and why; "
                  f"Fp8Rule(min_fp8_flops=0) converts every GEMM.",
                  Fp8ConversionWarning, stacklevel=_caller_level())


def _warn(owner: Any, label: str, path: str, entry: dict[str, Any], reason: str,
          text: str) -> None:
    key = (owner, path, reason)
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    where = entry.get("where") or (f"module {path!r}" if path else "the root module")
    warnings.warn(f"jax_fp8 fp8_model({label}): {where} ({entry['type']}), matched by "
                  f"{entry['rule']!r}, runs no GEMM in FP8: {text}.",
                  Fp8ConversionWarning, stacklevel=_caller_level())


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    origin = getattr(spec, "origin", None)
    return None if origin is None else os.path.dirname(os.path.abspath(origin)) + os.sep


# The frames a warning skips: jax_fp8's, JAX's and the frameworks' (the converted model's
# call goes through them).
_LIBRARIES = tuple(d for d in (_HERE + os.sep, *map(_package_dir, ("jax", "flax", "equinox")))
                   if d is not None)


def _caller_level() -> int:
    """The stacklevel of the first frame outside jax_fp8, Flax and JAX: the user's call
    that ran the converted model."""
    frame: Any = sys._getframe(1)  # noqa: SLF001  (Python's, not JAX's)
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith(_LIBRARIES)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    return level
