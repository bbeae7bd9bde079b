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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp8._primitives import common, partition

amax_p = Primitive("jax_fp8_amax")
partition.require_devices_during_lowering(amax_p)


def _local_amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


amax_p.def_impl(common.eager_impl(amax_p))
# (x.update keeps shard_map's manual-axis type of x on the result.)
amax_p.def_abstract_eval(lambda x: x.update(shape=(), dtype=np.float32, weak_type=False))


def _batch(args, dims):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    return jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim))).astype(jnp.float32), 0


batching.primitive_batchers[amax_p] = _batch
ad.primitive_jvps[amax_p] = lambda primals, tangents: jax.jvp(_local_amax, primals, tangents)


def _partition_fn(mesh, arg_shapes, result_shape):
    del result_shape
    axes = tuple(mesh.axis_names)

    def lower(x):
        return jax.lax.pmax(_local_amax(x), axes)

    return mesh, lower, NamedSharding(mesh, PartitionSpec()), (arg_shapes[0].sharding,)


def _infer(mesh, arg_shapes, result_shape):
    del arg_shapes, result_shape
    return NamedSharding(mesh, PartitionSpec())


def _sharding_rule(mesh, operand_types, result_types):
    del mesh, result_types
    factors = [f"d{i}" for i in range(len(operand_types[0].shape))]
    # Every axis is reduced: the result is a scalar, replicated (the partition
    # function does the all-device max itself).
    return " ".join(factors) + " -> ", {"reduction_factors": tuple(factors)}


@functools.lru_cache(maxsize=None)
def _partitioned_amax():
    fn = custom_partitioning(_local_amax)
    fn.def_partition(partition=_partition_fn, infer_sharding_from_operands=_infer,
                     sharding_rule=_sharding_rule)
    return fn


def _lowering(ctx, x):
    if partition.needs_partitioning(ctx) and ctx.avals_in[0].ndim > 0:
        return mlir.lower_fun(_partitioned_amax(), multiple_results=False)(ctx, x)
    return mlir.lower_fun(_local_amax, multiple_results=False)(ctx, x)


mlir.register_lowering(amax_p, _lowering)


varying_axes = common.varying_axes


def on_explicit_mesh(x) -> bool:
    """Whether x's type carries a mesh with Explicit axes (sharding in types)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or getattr(mesh, "empty", True):
        return False
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))


def amax(x) -> jax.Array:
    """max |x| over the whole tensor as a float32 scalar (NaN propagates)."""
    if varying_axes(x) or on_explicit_mesh(x):
        # Inside shard_map a per-device value: plain jnp keeps its manual-axis type
        # (the user, or fp8_dot_general's backward, reduces it across devices). On a
        # mesh with Explicit axes JAX types the max itself (replicated result, its own
        # all-reduce); custom_partitioning's pmax there lowers, on jax 0.11, to an
        # all-reduce whose reducer XLA's CPU backend rejects.
        return _local_amax(x)
    return amax_p.bind(x)


# --------------------------------------------------------------- amax for a state under vmap

amax_for_state_p = Primitive("jax_fp8_amax_for_state")


def amax_for_state(amax, like):
    """`amax` as the observation of the state whose scale is `like` (same shape).

    The identity, except under ``jax.vmap`` where `amax` is batched and the state is not
    (one meta shared by every example): then the max over the batch axis. JAX would
    otherwise *sum* the batch's cotangents into the unbatched meta.
    """
    return amax_for_state_p.bind(amax, like)


def _afs_abstract_eval(amax, like):
    if amax.shape != like.shape:
        raise ValueError(f"jax_fp8_amax_for_state: amax shape {amax.shape} must equal the "
                         f"state's scale shape {like.shape}")
    return amax


def _afs_batch(args, dims):
    (amax, like), (d_amax, d_like) = args, dims
    if d_amax is not None and d_like is None:
        return jnp.max(amax, axis=d_amax), None
    if d_amax is None and d_like is not None:  # a per-example state, one amax: broadcast
        return amax_for_state_p.bind(amax, jnp.take(like, 0, axis=d_like)), None
    return amax_for_state_p.bind(amax, jnp.moveaxis(like, d_like, d_amax)), d_amax


amax_for_state_p.def_abstract_eval(_afs_abstract_eval)
amax_for_state_p.def_impl(lambda amax, like: amax)
mlir.register_lowering(amax_for_state_p, lambda ctx, amax, like: [amax])
batching.primitive_batchers[amax_for_state_p] = _afs_batch
# Bookkeeping, not a function to differentiate (it lives in a backward pass).
ad.primitive_jvps[amax_for_state_p] = lambda primals, tangents: (
    amax_for_state_p.bind(*primals), ad.Zero(jax.typeof(primals[0]).to_tangent_aval()))
