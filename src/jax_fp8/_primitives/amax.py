"""The `jax_fp8_amax` primitive: max |x| over a whole tensor, one collective per step.

On one device it is `jnp.max(jnp.abs(x))` in float32. Under a multi-device jit, XLA's
partitioner would reduce each amax over exactly the mesh axes its tensor is sharded
on, so a tensor-parallel step gets amax all-reduces with different replica groups
(the weights' over "model", the activations' over "data" and "model"), which XLA's
all-reduce combiner cannot merge. Here each device takes the max of the shard it
holds and the result is a max over ALL mesh devices (max is idempotent, so devices
that hold the same data change nothing). Every amax of the step then has the same
replica groups, and XLA combines them into one all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from jax_fp8._primitives import axis_types, base


def _local_amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _shardings(params: dict[str, Any], mesh: jax.sharding.Mesh, arg_shapes: Sequence[Any],
               ) -> tuple[tuple[Any], NamedSharding]:
    del params
    # PartitionSpec's constructor is unannotated in JAX.
    return (arg_shapes[0].sharding,), NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]


def _sharding_rule(params: dict[str, Any], operand_types: Sequence[Any],
                   ) -> tuple[str, dict[str, Any]]:
    del params
    factors = [f"d{i}" for i in range(len(operand_types[0].shape))]
    # Every axis is reduced: the result is a scalar, replicated (each device's max is
    # combined over all devices).
    return " ".join(factors) + " -> ", {"reduction_factors": tuple(factors)}


def _abstract_eval(x: ShapedArray) -> ShapedArray:
    # (x.update keeps shard_map's manual-axis type of x on the result; on a mesh with
    # Explicit axes the scalar is typed replicated on it, as jnp.max's is.)
    if axis_types.on_explicit_mesh(x):
        # ShapedArray.update and PartitionSpec's constructor are unannotated in JAX.
        return cast(ShapedArray, x.update(  # type: ignore[no-untyped-call]
            shape=(), dtype=np.float32, weak_type=False,
            sharding=NamedSharding(x.sharding.mesh, PartitionSpec())))  # type: ignore[no-untyped-call]
    return cast(ShapedArray, x.update(shape=(), dtype=np.float32, weak_type=False))  # type: ignore[no-untyped-call]


def _reference_where(x: ShapedArray) -> str | None:
    """Where the max runs as XLA's own reduction in the caller's types, and why."""
    if axis_types.varying_axes(x):
        return ("inside shard_map: each device's own amax (the caller reduces it across "
                "devices)")
    if axis_types.on_explicit_mesh(x):
        # custom_partitioning's pmax there lowers (jax 0.11) to an all-reduce whose
        # reducer XLA's CPU backend rejects.
        return ("on a mesh with Explicit axes: JAX types the max itself (a replicated "
                "scalar, its own all-reduce)")
    return None


amax_p = base.register(base.Spec(
    "jax_fp8_amax", _abstract_eval, _local_amax, batch="reference", jvp="reference",
    reference_where=_reference_where,
    partitioning=base.Partitioning(
        # (jax.lax.pmax is unannotated in JAX.)
        _shardings, _sharding_rule,
        combine=lambda m, mesh: jax.lax.pmax(m, mesh.axis_names),  # type: ignore[no-untyped-call]
        supports=lambda x: x.ndim > 0, needs_kernel=False)))

varying_axes = axis_types.varying_axes


def amax(x: ArrayLike) -> jax.Array:
    """max |x| over the whole tensor as a float32 scalar (NaN propagates).

    Inside shard_map a per-device value (the user, or fp8_dot_general's backward, reduces
    it across devices); on a mesh with Explicit axes typed replicated (`_reference_where`)."""
    return cast(jax.Array, amax_p.bind(x))


# --------------------------------------------------------------- amax for a state under vmap

def amax_for_state(amax: jax.Array, like: jax.Array) -> jax.Array:
    """`amax` as the observation of the state whose scale is `like` (same shape).

    The identity, except under ``jax.vmap`` where `amax` is batched and the state is not
    (one meta shared by every example): then the max over the batch axis. JAX would
    otherwise *sum* the batch's cotangents into the unbatched meta.
    """
    return cast(jax.Array, amax_for_state_p.bind(amax, like))


def _afs_abstract_eval(amax: ShapedArray, like: ShapedArray) -> ShapedArray:
    if amax.shape != like.shape:
        raise ValueError(f"jax_fp8_amax_for_state: amax shape {amax.shape} must equal the "
                         f"state's scale shape {like.shape}")
    return amax


def _afs_batch(args: Sequence[jax.Array], dims: Sequence[Any],
               **params: Any) -> tuple[jax.Array, int | None]:
    (amax, like), (d_amax, d_like) = args, dims
    if d_amax is not None and d_like is None:
        return jnp.max(amax, axis=d_amax), None
    if d_amax is None and d_like is not None:  # a per-example state, one amax: broadcast
        return amax_for_state_p.bind(amax, jnp.take(like, 0, axis=d_like), **params), None
    return amax_for_state_p.bind(amax, jnp.moveaxis(like, d_like, d_amax), **params), d_amax


# Bookkeeping, not a function to differentiate (it lives in a backward pass): zero tangents.
amax_for_state_p = base.register(base.Spec(
    "jax_fp8_amax_for_state", _afs_abstract_eval, lambda amax, like: amax, batch=_afs_batch))
