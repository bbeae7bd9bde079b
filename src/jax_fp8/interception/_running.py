"""The running state of this thread's converting calls: the innermost matched module (its
`Site`, `running`), the converting calls (`Conversion`, `current`), and which of a site's
parameters an array is (`weight_of`). Part of `jax_fp8.interception`, which re-exports its
public names.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, cast

from jax_fp8.interception._follow import chain, local
from jax_fp8.interception._install import conversion_key
from jax_fp8.interception._site import Site

__all__ = ["Conversion", "current", "running", "weight_of"]


def weight_of(site: Site, x: Any) -> str | None:
    """The name of the parameter of ``site``'s module that ``x`` is, directly or through
    `FOLLOWED` operations (`follow`); None for any other array."""
    # The nearest of the arrays x was made from (a weight passed into a traced body is the
    # body's own argument, made from the caller's).
    for a in chain(x):
        name = next((name for name, w in site.weights if a is w), None)
        if name is not None:
            return name
    return None


def _frames() -> list[Any]:
    if not hasattr(local, "frames"):
        local.frames = []
    return cast("list[Any]", local.frames)


_SITE_KEY: Any = object()   # `running`'s default key: the site's own (`Site.key`)


@contextlib.contextmanager
def running(site: Any, key: Any = _SITE_KEY) -> Iterator[None]:
    """Marks ``site`` (a `Site`, a function returning one or None, or None) as the
    innermost running module method; None: no conversion inside.

    ``key``: what decides how ``site`` converts, part of ``jax.jit``'s cache key for the
    duration (`conversion_key`); by default ``site.key`` (None for None). A site given as
    a function needs it given."""
    if key is _SITE_KEY:
        if site is not None and not isinstance(site, Site):
            raise TypeError("jax_fp8.interception.running: a site given as a function needs "
                            "its key= (what decides how it converts)")
        key = None if site is None else site.key
    frames = _frames()
    frames.append(site)
    try:
        if conversion_key.value == key:
            yield
        else:
            with conversion_key(key):
                yield
    finally:
        frames.pop()


@dataclasses.dataclass(eq=False)
class Conversion:
    """One converting call (`converting`): the model it runs and what its adapter keeps
    for it (``data``, shared with the converting calls nested in it: e.g. linen's
    recorded parameters); ``tag`` is what the adapter tells its own nested calls by."""

    owner: Any
    label: str
    tag: Any = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


def _conversions() -> list[Conversion]:
    if not hasattr(local, "conversions"):
        local.conversions = []
    return cast("list[Conversion]", local.conversions)


def current() -> Conversion | None:
    """The innermost converting call running in this thread, or None."""
    conversions = _conversions()
    return conversions[-1] if conversions else None


def _innermost() -> Site | None:
    frames = _frames()
    site = frames[-1] if frames else None
    return site() if callable(site) else site
