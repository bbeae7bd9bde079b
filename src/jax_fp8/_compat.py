"""Every JAX name jax_fp8 reads that JAX does not make public, and the shims across JAX versions,
in one place (the primitive frame's own live below it, in ``_primitives/jax_compat.py``, and
are re-exported here).

The guards that stop a training loop from silently skipping the FP8 update read JAX's
traces: which trace a tracer belongs to, whether it differentiates, and which
transformation (a loop body, a branch) it traces for. JAX has no public API for these.
They are read here only, each behind a capability check: `check()` runs at import and
raises ImportError when one is missing, and tests/recipes/test_compat.py checks that each still
behaves (a JAX upgrade that renames one fails loudly instead of disarming a guard).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax

# The names the primitive frame reads live below it, in jax_fp8._primitives.jax_compat (the
# frame imports nothing above itself); re-exported here with the rest.
from jax_fp8._primitives.jax_compat import (
    EXPLICIT,
    missing as _frame_missing,
    pvary,
    require_devices_during_lowering,
)

__all__ = ["EXPLICIT", "axis_names", "batched_here", "is_batch_trace", "check", "current_trace",
           "is_differentiation_trace", "jit_key_flag", "jit_key_state", "numpy_contractions",
           "parent_trace", "pvary", "require_devices_during_lowering", "staged_argument",
           "traced_for", "trace_of"]

_MISSING = ("jax_fp8 needs {what} of this jax ({version}), which it no longer has; the "
            "trace-time guards of the FP8 training loops depend on it. Install a jax "
            "version jax_fp8 supports (see its README), or report it.")


def _load() -> tuple[ModuleType, ModuleType, ModuleType, ModuleType, ModuleType]:
    from jax._src import config, core
    from jax._src.interpreters import ad, batching
    from jax._src.numpy import tensor_contractions
    return config, core, ad, batching, tensor_contractions


try:
    _config, _core, _ad, _batching, _contractions = _load()
except ImportError as err:  # pragma: no cover - a JAX that moved these modules
    raise ImportError(_MISSING.format(what=f"jax._src ({err})", version=jax.__version__)) from err

# The differentiation traces: forward-mode JVP, and linearize (jax.grad / jax.vjp).
_AD_TRACE_TYPES = tuple(getattr(_ad, name) for name in ("JVPTrace", "LinearizeTrace")
                        if hasattr(_ad, name))


def check() -> None:
    """Raises ImportError when a private JAX name the guards read is missing."""
    needs = {"jax._src.core.trace_ctx": hasattr(_core, "trace_ctx"),
             "jax._src.interpreters.ad.JVPTrace": hasattr(_ad, "JVPTrace"),
             "jax._src.interpreters.ad.LinearizeTrace": hasattr(_ad, "LinearizeTrace"),
             "jax._src.interpreters.batching.BatchTrace": hasattr(_batching, "BatchTrace"),
             "jax._src.config.bool_state": hasattr(_config, "bool_state"),
             "jax._src.config.string_or_object_state": hasattr(_config,
                                                               "string_or_object_state"),
             "jax._src.core.get_axis_env": hasattr(_core, "get_axis_env"),
             "jax._src.numpy.tensor_contractions.matmul": callable(
                 getattr(_contractions, "matmul", None)),
             "jax._src.numpy.tensor_contractions.dot": callable(
                 getattr(_contractions, "dot", None))}
    missing = [name for name, ok in needs.items() if not ok] + _frame_missing()
    if missing:
        raise ImportError(_MISSING.format(what=", ".join(missing), version=jax.__version__))


check()


def current_trace() -> Any:
    """The trace JAX is tracing under now (the evaluation trace outside any transformation)."""
    return _core.trace_ctx.trace


def parent_trace(trace: Any) -> Any:
    """The trace `trace` is nested in, or None."""
    return getattr(trace, "parent_trace", None)


def trace_of(x: Any) -> Any:
    """The trace a tracer belongs to; None for a concrete array."""
    return getattr(x, "_trace", None) if isinstance(x, jax.core.Tracer) else None


def is_differentiation_trace(trace: Any) -> bool:
    """Whether `trace` differentiates (``jax.jvp``, ``jax.grad``, ``jax.vjp``, ``linearize``)."""
    return isinstance(trace, _AD_TRACE_TYPES)


def batched_here(x: Any) -> bool:
    """Whether ``x`` is batched by the ``jax.vmap`` being traced now (the current trace is
    a vmap's and ``x`` one of its tracers): a function called per example that takes its
    whole batch in one operation (`jax.custom_batching.custom_vmap`) decides so here."""
    trace = current_trace()
    return (hasattr(_batching, "BatchTrace") and isinstance(trace, _batching.BatchTrace)
            and trace_of(x) is trace)


def is_batch_trace(trace: Any) -> bool:
    """Whether `trace` is a ``jax.vmap``'s (Flax's ``nn.vmap`` included)."""
    return hasattr(_batching, "BatchTrace") and isinstance(trace, _batching.BatchTrace)


def traced_for(trace: Any) -> str | None:
    """What a staging trace traces for (e.g. "scan", "while_body", "cond", "jit"), else None."""
    return getattr(getattr(getattr(trace, "frame", None), "debug_info", None), "traced_for",
                   None)


def staged_argument(x: Any) -> str | None:
    """The name JAX gives ``x`` among the arguments of the function its staging trace
    traces (e.g. ``"c[0][0]['fp8_meta']['input']"`` for a leaf of a ``lax.scan`` body's
    carry, ``"xs[...]"`` for a slice of its xs), or None: ``x`` is no tracer, not an
    argument of its trace (a value computed there or closed over), or of a trace that
    records no argument names."""
    trace = trace_of(x)
    frame = getattr(trace, "frame", None)
    names = getattr(getattr(frame, "debug_info", None), "arg_names", None)
    var, invars = getattr(x, "val", None), getattr(frame, "invars", None)
    if var is None or not invars or not names or len(names) != len(invars):
        return None
    return next((names[i] for i, v in enumerate(invars) if v is var), None)


def jit_key_flag(name: str, help: str) -> Any:
    """A thread-local boolean JAX configuration option that is part of ``jit``'s cache key
    and of the trace context: a function traced under one value is traced anew under the
    other. ``flag(True)`` is a context manager; ``flag.value`` the current value."""
    return _config.bool_state(name, False, help, include_in_jit_key=True,
                              include_in_trace_context=True)


def jit_key_state(name: str, help: str) -> Any:
    """A thread-local JAX configuration option holding any hashable value (None by
    default) that is part of ``jit``'s cache key and of the trace context: a function
    traced under one value is traced anew under another. ``state(value)`` is a context
    manager; ``state.value`` the current value."""
    return _config.string_or_object_state(name, None, help, include_in_jit_key=True,
                                          include_in_trace_context=True)


def numpy_contractions() -> ModuleType:
    """The module whose ``matmul`` and ``dot`` the ``@`` operator and the ``.dot`` method of
    JAX arrays and tracers call (looked up at each call): the converters replace them there
    as well as in ``jax.numpy`` while a converted model runs."""
    return _contractions


def axis_names() -> tuple[Any, ...]:
    """The named axes in scope (``pmap``, ``shard_map``, ``vmap(axis_name=...)``)."""
    return tuple(_core.get_axis_env().axis_names())
