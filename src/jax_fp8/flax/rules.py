"""The Flax side of model conversion: the framework-neutral rules (`jax_fp8.rules`) and GEMM
interception (`jax_fp8.interception`), plus linen's recording ``Module.param``.

While a converted linen model runs, ``nn.Module.param`` also records the very array it
returns for the converting call running in this thread, so that a GEMM of it is known as a
GEMM of that parameter.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from jax_fp8.interception import (
    ORIGINAL,
    Site,
    current,
    explicit_einsum,
    local,
    note,
    reporting,
    running,
    through,
    track,
)
from jax_fp8.rules import AUTO_MIN_FP8_FLOPS, Fp8ConversionWarning, Fp8Rule, as_rules, rule_for

__all__ = ["AUTO_MIN_FP8_FLOPS", "ORIGINAL", "PARAM_PATCH", "Fp8ConversionWarning", "Fp8Rule",
           "Site", "as_rules", "explicit_einsum", "local", "note", "recorded_params",
           "reporting", "rule_for", "running", "track"]


def _recording_param(module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module.param`` that also records, for the converted call running in this
    thread, the very array it returns (after any unboxing: a partitioned parameter under
    a mesh comes back as a new, sharding-constrained array), so a GEMM of it, or of an
    array made from it by the operations the conversion follows, is known as a GEMM of
    the parameter ``name``."""
    value = through(nn.Module, "param")(module, name, *args, **kwargs)
    params = recorded_params()
    if params is not None and hasattr(value, "dtype"):
        params.setdefault(id(module), (module, {}))[1][name] = value
        track(value)
    return value


def recorded_params() -> dict[int, tuple[nn.Module, dict[str, Any]]] | None:
    """``{id(module): (module, {name: array})}``: the parameters linen modules' ``self.param``
    returned in this thread's converting call (`jax_fp8.interception.converting`), for
    that call only; None outside one."""
    conversion = current()
    return None if conversion is None else conversion.data.setdefault("params", {})


# What a converting call of a linen model installs besides the GEMM functions.
PARAM_PATCH = (nn.Module, "param", _recording_param)

