"""Following a weight: the arrays a converting call made from a module's parameters.

While a converting call runs (`jax_fp8.interception.converting`), the ``bind`` of each
`FOLLOWED` primitive records which of its results come from a tracked array (a running
module's parameter, `track`), and `follow` walks those records back from a GEMM's operand
to the parameter.

A weight passed as an argument into a function that a JAX transformation traces with
arrays of its own (`TRACED_BODIES`: ``jax.shard_map``, ``jax.jit``, ``jax.checkpoint`` /
``jax.remat`` applied during the converting call, as MaxText's mixture-of-experts layer
hands its expert kernels to a ``shard_map``) is followed into the body: each argument of
the traced body is recorded as made from the caller's argument at its place ("argument of
shard_map"). Such a transformation, given a weight, traces its body anew for each call
(a trace reused for another call would carry the first call's weight). Part of
`jax_fp8.interception`, which re-exports its public names.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_fp8.interception._install import through

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


def _carries(prim: Any, x: Any, out: Any, params: dict[str, Any]) -> bool:
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


def _following_bind(prim: Any) -> Callable[..., Any]:
    def bind(*args: Any, **params: Any) -> Any:
        out = through(prim, "bind")(*args, **params)
        tracked = getattr(local, "tracked", None)
        if tracked is not None and args:
            entry = tracked.get(id(args[0]))
            if entry is not None and entry[0] is args[0] and _carries(prim, args[0], out,
                                                                       params):
                tracked[id(out)] = (out, args[0], FOLLOWED[prim])
        return out
    return bind


_BINDS = [(prim, "bind", _following_bind(prim)) for prim in FOLLOWED]


def track(*arrays: Any) -> None:
    """Marks ``arrays`` (a running module's parameters) as the start of the chains
    `follow` walks back, for this thread's converting call."""
    tracked = getattr(local, "tracked", None)
    if tracked is None:
        return
    for x in arrays:
        if hasattr(x, "dtype") and id(x) not in tracked:
            tracked[id(x)] = (x, None, None)


def chain(x: Any) -> list[Any]:
    """``x`` and the arrays it was made from through `FOLLOWED` operations or as the
    argument of a traced body, nearest first (``[x]`` for an array made otherwise)."""
    tracked = getattr(local, "tracked", None) or {}
    arrays = [x]
    while True:
        entry = tracked.get(id(x))
        if entry is None or entry[0] is not x or entry[1] is None:
            return arrays
        x = entry[1]
        arrays.append(x)


def follow(x: Any) -> tuple[Any, tuple[str, ...]]:
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


# --------------------------------------------------------- weights entering traced bodies

def _tracked_leaves(args: Any) -> bool:
    tracked = getattr(local, "tracked", None)
    if not tracked:
        return False
    return any((e := tracked.get(id(leaf))) is not None and e[0] is leaf
               for leaf in jax.tree.leaves(args))


def _link(outer: Any, inner: Any, step: str) -> None:
    """Records each leaf of the body's arguments ``inner`` as made from the caller's leaf
    at its place in ``outer`` (the same pytree structure), where that one is tracked."""
    tracked = getattr(local, "tracked", None)
    outer_leaves, outer_tree = jax.tree.flatten(outer)
    inner_leaves, inner_tree = jax.tree.flatten(inner)
    if tracked is None or len(outer_leaves) != len(inner_leaves) \
            or str(outer_tree) != str(inner_tree):
        return
    for o, i in zip(outer_leaves, inner_leaves, strict=True):
        entry = tracked.get(id(o))
        if i is not o and entry is not None and entry[0] is o and hasattr(i, "dtype"):
            tracked[id(i)] = (i, o, step)


class _Following:
    """What a `TRACED_BODIES` transformation returns during a converting call: the
    transformed function, except that a call given a tracked array traces a body of its
    own that records its arguments as made from the caller's (`_link`)."""

    def __init__(self, transform: Callable[..., Any], fun: Callable[..., Any],
                 args: tuple[Any, ...], kwargs: dict[str, Any], step: str) -> None:
        self._transform, self._fun, self._step = transform, fun, step
        self._args, self._kwargs = args, kwargs
        self._plain = transform(fun, *args, **kwargs)
        functools.update_wrapper(self, fun)

    def __call__(self, *call_args: Any, **call_kwargs: Any) -> Any:
        if not _tracked_leaves((call_args, call_kwargs)):
            return self._plain(*call_args, **call_kwargs)
        fun, step, outer = self._fun, self._step, (call_args, call_kwargs)

        @functools.wraps(fun)
        def body(*args: Any, **kwargs: Any) -> Any:
            _link(outer, (args, kwargs), step)
            return fun(*args, **kwargs)
        return self._transform(body, *self._args, **self._kwargs)(*call_args, **call_kwargs)

    def __getattr__(self, name: str) -> Any:   # jit's lower / trace / eval_shape, ...
        return getattr(self._plain, name)


def _following_transform(owner: Any, name: str, function_first: bool) -> Callable[..., Any]:
    step = f"argument of {name}"

    def transform(*args: Any, **kwargs: Any) -> Any:
        original = through(owner, name)
        if function_first and (not args or args[0] is None):
            # A decorator factory (``jax.shard_map(mesh=..., ...)``): the function later.
            return lambda fun: transform(fun, *args[1:], **kwargs)
        if not args or not callable(args[0]):
            return original(*args, **kwargs)
        return _Following(original, args[0], args[1:], kwargs, step)
    functools.update_wrapper(transform, getattr(owner, name))
    return transform


# The transformations whose traced bodies a weight is followed into: (owner, attribute).
TRACED_BODIES = [(jax, "shard_map"), (jax, "jit"), (jax, "checkpoint"), (jax, "remat")]
_TRANSFORMS = [(owner, name, _following_transform(owner, name, True))
               for owner, name in TRACED_BODIES]
