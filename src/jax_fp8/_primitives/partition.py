"""Sharded states: each device updates the shards it holds, with no all-gather.

Every leading (non-history) axis of a state indexes independent tensors, so the
update partitions trivially along them; only the history axis must be whole on a
device. Under a multi-device jit the custom call is wrapped in
`custom_partitioning` with a Shardy rule that says exactly that: each state gets
its own leading factors (passed through to its results) and a history factor
that needs replication.
"""

from __future__ import annotations

import functools

from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec


def require_devices_during_lowering(prim) -> None:
    """custom_partitioning needs the device assignment when it is lowered; JAX only
    provides it for primitives in this (internal) set, as custom_partitioning's own."""
    from jax._src import dispatch  # no public equivalent as of jax 0.11

    dispatch.prim_requires_devices_during_lowering.add(prim)


def needs_partitioning(ctx) -> bool:
    """True under a jit over several devices (not inside shard_map or pmap), except when
    lowering for ``jax.export``: custom_partitioning runs a Python callback inside XLA's
    partitioner, which a serialized program cannot carry. There the bare custom call is
    emitted and XLA's partitioner gathers its (small) operands instead: same bits."""
    params = getattr(ctx.module_context, "lowering_parameters", None)
    if getattr(params, "for_export", False):
        return False
    return getattr(ctx.module_context.axis_context, "num_devices", 1) > 1


def _padded_spec(sharding, ndim):
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (ndim - len(spec))


def _layout(static):
    """(num_states, operand kinds) of a flat operand list."""
    params = dict(static[1])
    g = len(params["scaled_max"])
    kinds = ["history"] * g + ["scale"] * g
    kinds += ["scale_inv"] * g if params["has_scale_inv"] else []
    kinds += ["amax"] * g if params["has_amax"] else []
    return g, kinds


def _sharding_rule(static, mesh, operand_types, result_types):
    del mesh, result_types
    g, kinds = _layout(static)
    factors, need_replication = [], []
    for i in range(g):
        lead = [f"s{i}d{d}" for d in range(len(operand_types[i].shape) - 1)]
        factors.append(lead)
        need_replication.append(f"s{i}h")
    operands = []
    for k, kind in enumerate(kinds):
        i = k % g
        operands.append(" ".join(factors[i] + ([need_replication[i]] if kind == "history" else [])))
    results = operands[:g] + operands[g:2 * g] + operands[g:2 * g]
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    return rule, {"need_replication_factors": tuple(need_replication)}


def _shardings(static, mesh, arg_shapes):
    """Per-operand and per-result shardings: each state's history's leading spec."""
    g, kinds = _layout(static)
    lead = [_padded_spec(arg_shapes[i].sharding, arg_shapes[i].ndim)[:-1] for i in range(g)]
    hist = [NamedSharding(mesh, PartitionSpec(*lead[i], None)) for i in range(g)]
    small = [NamedSharding(mesh, PartitionSpec(*lead[i])) for i in range(g)]
    args = [hist[k % g] if kind == "history" else small[k % g] for k, kind in enumerate(kinds)]
    return args, hist + small + small


def _infer(static, mesh, arg_shapes, result_shape):
    del result_shape
    return tuple(_shardings(static, mesh, arg_shapes)[1])


def _partition_fn(static, mesh, arg_shapes, result_shape):
    del result_shape
    prim, params = static
    args, results = _shardings(static, mesh, arg_shapes)

    def local_update(*operands):
        return tuple(prim.bind(*operands, implementation="local", **dict(params)))

    return mesh, local_update, tuple(results), tuple(args)


@functools.lru_cache(maxsize=None)
def _partitioned_update():
    def update(static, *operands):
        prim, params = static
        return tuple(prim.bind(*operands, implementation="local", **dict(params)))

    update = custom_partitioning(update, static_argnums=(0,))
    update.def_partition(partition=_partition_fn, infer_sharding_from_operands=_infer,
                         sharding_rule=_sharding_rule)
    return update


def partitioned_lowering(prim, ctx, *operands, **params):
    static = (prim, tuple(sorted(params.items())))
    fn = functools.partial(_partitioned_update(), static)
    return mlir.lower_fun(lambda *ops: list(fn(*ops)), multiple_results=True)(ctx, *operands)
