"""The JAX names the primitive frame reads that differ across JAX versions or that JAX does
not make public, in one place below the frame (``jax_fp8._compat`` re-exports them).

`check()` runs at import and raises ImportError when a private name is missing, so a JAX
upgrade that renames one fails loudly instead of lowering partitioned primitives without
their device assignment.
"""

from __future__ import annotations

from typing import Any

import jax

_MISSING = ("jax_fp8 needs {what} of this jax ({version}), which it no longer has; its "
            "partitioned primitives depend on it. Install a jax version jax_fp8 supports (see "
            "its README), or report it.")

try:
    from jax._src import dispatch as _dispatch
except ImportError as err:  # pragma: no cover - a JAX that moved this module
    raise ImportError(_MISSING.format(what=f"jax._src ({err})", version=jax.__version__)) from err

# Meshes with Explicit axes (sharding in types); None on a jax without them.
EXPLICIT = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)


def missing() -> list[str]:
    """The private JAX names the frame reads that this jax lacks."""
    needs = {"jax._src.dispatch.prim_requires_devices_during_lowering":
             hasattr(_dispatch, "prim_requires_devices_during_lowering")}
    return [name for name, ok in needs.items() if not ok]


def check() -> None:
    """Raises ImportError when a private JAX name the frame reads is missing."""
    if missing():
        raise ImportError(_MISSING.format(what=", ".join(missing()), version=jax.__version__))


check()


def pvary(x: Any, axes: tuple[str, ...] | str) -> Any:
    """``x`` made to vary over the manual mesh axes `axes` (inside shard_map)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return getattr(jax.lax, "pvary")(x, axes)  # noqa: B009 (older jax; not in the stubs)


def require_devices_during_lowering(prim: Any) -> None:
    """custom_partitioning needs the device assignment when it is lowered; JAX provides it
    only for the primitives in this (internal) set, as for custom_partitioning's own."""
    _dispatch.prim_requires_devices_during_lowering.add(prim)
