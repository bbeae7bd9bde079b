"""Helpers shared by the primitives: eager execution, shard_map's varying manual axes, Explicit
meshes, partition specs."""

from __future__ import annotations

import functools

import jax

from jax_fp8 import _compat


def eager_impl(prim):
    """An impl rule that runs `prim` as a compiled one-primitive program, also under
    ``jax.disable_jit()`` (which would otherwise turn the jit back into this impl)."""

    @functools.cache
    def compiled(params):
        return jax.jit(functools.partial(prim.bind, **dict(params)))

    def impl(*args, **params):
        with jax.disable_jit(False):
            return compiled(tuple(sorted(params.items())))(*args)

    return impl


def varying_axes(x) -> frozenset:
    """The manual mesh axes x (an array or an abstract value) varies over inside
    shard_map; empty elsewhere."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    if mat is not None:  # jax >= 0.10
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))  # earlier spelling


def vary_like(arrays):
    """Makes every array of `arrays` vary over the union of their manual axes (inside
    shard_map), so a primitive taking them all types its results over that union."""
    union = frozenset().union(*(varying_axes(a) for a in arrays))
    if not union:
        return list(arrays)
    out = []
    for a in arrays:
        missing = tuple(sorted(union - varying_axes(a)))
        out.append(_compat.pvary(a, missing) if missing else a)
    return out


def check_same_varying(name, avals):
    """Abstract-eval check that all operands vary over the same manual axes (the
    public wrappers make them so with `vary_like`)."""
    sets = {varying_axes(a) for a in avals}
    if len(sets) > 1:
        raise ValueError(f"{name}: operands vary over different manual axes "
                         f"{sorted(map(sorted, sets))}; use the public jax_fp8 functions, "
                         "which align them")


def on_explicit_mesh(x) -> bool:
    """Whether x's type (an array or an abstract value) carries a mesh with Explicit axes
    (sharding in types)."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return False
    return _compat.EXPLICIT is not None and _compat.EXPLICIT in tuple(getattr(mesh, "axis_types",
                                                                               ()))


def check_not_explicit(name, aval):
    """Arrays typed with an Explicit-axes mesh sharding would need sharding rules for
    every result; refuse them with a clear error (Auto axes and shard_map work)."""
    if on_explicit_mesh(aval):
        raise NotImplementedError(
            f"{name}: arrays sharded over a mesh with Explicit axes are not supported; use "
            f"Auto axes (jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto, ...))) "
            f"or shard_map")


# ------------------------------------------------------------------------ partition specs

def padded_spec(sharding, ndim) -> tuple:
    """The PartitionSpec of `sharding` as a tuple of `ndim` entries (None: replicated)."""
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (ndim - len(spec))


def spec_axes(entry) -> tuple:
    """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def axes_size(mesh, axes) -> int:
    """How many shards `axes` (names of `mesh`) cut a dimension into."""
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def spec_entry(axes):
    """The PartitionSpec entry for a tuple of mesh axis names."""
    axes = tuple(axes)
    return None if not axes else axes[0] if len(axes) == 1 else axes
