"""The Flax side of model conversion: the framework-neutral rules (`jax_fp8.rules`) and GEMM
interception (`jax_fp8.interception`), plus linen's recording ``Module.param``.

While a converted linen model runs, ``nn.Module.param`` also records the very array it
returns for the converting call running in this thread, so that a GEMM of it is known as a
GEMM of that parameter.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn

from jax_fp8.interception import (
    ORIGINAL,
    Site,
    explicit_einsum,
    local,
    note,
    patched as _patched_gemms,
    reporting,
    running,
    track,
)
from jax_fp8.rules import AUTO_MIN_FP8_FLOPS, Fp8ConversionWarning, Fp8Rule, as_rules, rule_for

__all__ = ["AUTO_MIN_FP8_FLOPS", "ORIGINAL", "Fp8ConversionWarning", "Fp8Rule", "Site",
           "as_rules", "explicit_einsum", "local", "note", "patched", "reporting", "rule_for",
           "running", "track"]

_ORIGINAL_PARAM = nn.Module.param


def _recording_param(module, name, *args, **kwargs):
    """``nn.Module.param`` that also records, for the converted call running in this
    thread, the very array it returns (after any unboxing: a partitioned parameter under
    a mesh comes back as a new, sharding-constrained array), so a GEMM of it, or of an
    array made from it by the operations the conversion follows, is known as a GEMM of
    the parameter ``name``."""
    value = _ORIGINAL_PARAM(module, name, *args, **kwargs)
    params = getattr(local, "params", None)
    if params is not None and hasattr(value, "dtype"):
        params.setdefault(id(module), (module, {}))[1][name] = value
        track(value)
    return value


@contextlib.contextmanager
def patched():
    """`jax_fp8.interception.patched` with linen's recording ``Module.param``."""
    with _patched_gemms(extra=((nn.Module, "param", _recording_param),)):
        yield
