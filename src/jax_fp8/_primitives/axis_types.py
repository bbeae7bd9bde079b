"""What an array's type says about the mesh axes it is sharded over: the Manual axes it
varies over inside shard_map, and whether its mesh has Explicit axes (sharding in types).

The frame (base.py) applies both: ``Spec.same_varying`` aligns the operands' varying axes
(`vary_like`, checked by `check_same_varying`) and ``Partitioning.explicit`` runs a
primitive per device on Explicit meshes (`on_explicit_mesh`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jax_fp8._primitives import jax_compat


def varying_axes(x: Any) -> frozenset[Any]:
    """The manual mesh axes x (an array or an abstract value) varies over inside
    shard_map; empty elsewhere."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    if mat is not None:  # jax >= 0.10
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))  # earlier spelling


def vary_like(arrays: Sequence[Any]) -> list[Any]:
    """Every array of `arrays` made to vary over the union of their manual axes (inside
    shard_map), so a primitive taking them all types its results over that union; the
    arrays unchanged elsewhere."""
    union = frozenset().union(*(varying_axes(a) for a in arrays))
    if not union:
        return list(arrays)
    out = []
    for a in arrays:
        missing = tuple(sorted(union - varying_axes(a)))
        out.append(jax_compat.pvary(a, missing) if missing else a)
    return out


def check_same_varying(name: str, avals: Sequence[Any]) -> None:
    """Abstract-eval check that all operands of primitive `name` vary over the same
    manual axes (the frame's bind makes them so with `vary_like`).

    Raises:
      ValueError: naming the axes, where they differ.
    """
    sets = {varying_axes(a) for a in avals}
    if len(sets) > 1:
        raise ValueError(f"{name}: operands vary over different manual axes "
                         f"{sorted(map(sorted, sets))}; use the public jax_fp8 functions, "
                         "which align them")


def on_explicit_mesh(x: Any) -> bool:
    """Whether x's type (an array or an abstract value) carries a mesh with Explicit axes
    (sharding in types)."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return False
    explicit = jax_compat.EXPLICIT
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))
