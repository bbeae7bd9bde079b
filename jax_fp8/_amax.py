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

from jax_fp8 import _partition

amax_p = Primitive("jax_fp8_amax")
_partition.require_devices_during_lowering(amax_p)


def _local_amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


@functools.lru_cache(maxsize=None)
def _local_amax_jit():
    return jax.jit(lambda x: amax_p.bind(x))


amax_p.def_impl(lambda x: _local_amax_jit()(x))
amax_p.def_abstract_eval(lambda x: jax.core.ShapedArray((), np.float32))


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
    if _partition.needs_partitioning(ctx) and ctx.avals_in[0].ndim > 0:
        return mlir.lower_fun(_partitioned_amax(), multiple_results=False)(ctx, x)
    return mlir.lower_fun(_local_amax, multiple_results=False)(ctx, x)


mlir.register_lowering(amax_p, _lowering)


def varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over inside shard_map (empty elsewhere)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
    if mat is not None:  # jax >= 0.10
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))  # earlier spelling


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
