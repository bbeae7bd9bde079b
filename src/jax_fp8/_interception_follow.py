"""Following a weight: the arrays a converting call made from a module's parameters.

While a converting call runs (`jax_fp8.interception.patched`), the ``bind`` of each
`FOLLOWED` primitive records which of its results come from a tracked array (a running
module's parameter, `track`), and `follow` walks those records back from a GEMM's operand
to the parameter. Part of `jax_fp8.interception`, which re-exports its public names.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax

_FLOATS = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
_FLOAT64 = np.dtype(np.float64)

# The primitives a weight is followed through (by name, what the conversion calls them):
# JAX's public primitives, each checked at import (a JAX without one fails here, loudly).
FOLLOWED = {prim: name for prim, name in (
    (lax.convert_element_type_p, "cast"), (lax.reshape_p, "reshape"),
    (lax.transpose_p, "transpose"), (lax.squeeze_p, "squeeze"),
    (lax.broadcast_in_dim_p, "broadcast"), (lax.copy_p, "copy"),
    (lax.sharding_constraint_p, "sharding constraint"))}
for _prim in FOLLOWED:
    if not isinstance(_prim, jax.extend.core.Primitive) or not callable(_prim.bind):
        raise ImportError(f"jax_fp8.interception follows weights through jax.lax's "
                          f"{_prim!r}, which this jax ({jax.__version__}) does not have as "
                          f"a primitive; install a jax version jax_fp8 supports")

# This thread's converting call: its Sites (`running`), the arrays followed to a parameter
# (`track`), its report (`reporting`), and what a framework adapter keeps for it (the Flax
# adapter: the parameters its linen modules' ``self.param`` returned).
local = threading.local()


def _carries(prim, x, out, params) -> bool:
    """Whether ``out = prim.bind(x, ...)`` holds x's values, only cast, laid out or placed
    otherwise."""
    if isinstance(out, (tuple, list)) or not hasattr(out, "shape"):
        return False
    if prim is lax.convert_element_type_p:
        floats = _FLOATS | {_FLOAT64}
        return np.dtype(x.dtype) in floats and np.dtype(out.dtype) in floats
    if prim is lax.broadcast_in_dim_p:   # expand_dims: unit axes only
        return int(np.prod(out.shape)) == int(np.prod(np.shape(x)))
    return True


def _following_bind(prim, original):
    def bind(*args, **params):
        out = original(*args, **params)
        tracked = getattr(local, "tracked", None)
        if tracked is not None and args:
            entry = tracked.get(id(args[0]))
            if entry is not None and entry[0] is args[0] and _carries(prim, args[0], out,
                                                                       params):
                tracked[id(out)] = (out, args[0], FOLLOWED[prim])
        return out
    return bind


_BINDS = [(prim, "bind", _following_bind(prim, prim.bind)) for prim in FOLLOWED]


def track(*arrays) -> None:
    """Marks ``arrays`` (a running module's parameters) as the start of the chains
    `follow` walks back, for this thread's converting call."""
    tracked = getattr(local, "tracked", None)
    if tracked is None:
        return
    for x in arrays:
        if hasattr(x, "dtype") and id(x) not in tracked:
            tracked[id(x)] = (x, None, None)


def follow(x) -> tuple[Any, tuple[str, ...]]:
    """``(origin, steps)``: the tracked array ``x`` was made from through `FOLLOWED`
    operations (``x`` itself, no steps, for an array made otherwise), and those steps
    in the order they ran (e.g. ``("cast", "reshape", "sharding constraint")``)."""
    tracked = getattr(local, "tracked", None) or {}
    steps: list[str] = []
    while True:
        entry = tracked.get(id(x))
        if entry is None or entry[0] is not x or entry[1] is None:
            return x, tuple(reversed(steps))
        steps.append(entry[2])
        x = entry[1]
