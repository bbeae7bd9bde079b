"""PartitionSpecs as the partitioning rules read them: one entry per axis, each entry's
mesh axes, and how many shards they cut an axis into."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def padded_spec(sharding: Any, ndim: int) -> tuple[Any, ...]:
    """The PartitionSpec of `sharding` as a tuple of `ndim` entries (None: replicated)."""
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (ndim - len(spec))


def spec_axes(entry: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def axes_size(mesh: Any, axes: Iterable[str]) -> int:
    """How many shards `axes` (names of `mesh`) cut a dimension into."""
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size
