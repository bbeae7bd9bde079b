"""Sharded states: each device updates the shards it holds, with no all-gather.

Every leading (non-history) axis of a state indexes independent tensors, so the
update partitions trivially along them; only the history axis must be whole on a
device. `UPDATE` says exactly that to custom_partitioning (base.Partitioning): each
state gets its own leading factors (passed through to its results) and a history
factor that needs replication.
"""

from __future__ import annotations

from jax.sharding import NamedSharding, PartitionSpec

from jax_fp8._primitives import base


def _padded_spec(sharding, ndim):
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (ndim - len(spec))


def _layout(params):
    """(num_states, operand kinds) of a flat operand list."""
    g = len(params["scaled_max"])
    kinds = ["history"] * g + ["scale"] * g
    kinds += ["scale_inv"] * g if params["has_scale_inv"] else []
    kinds += ["amax"] * g if params["has_amax"] else []
    return g, kinds


def _sharding_rule(params, operand_types):
    g, kinds = _layout(params)
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


def _shardings(params, mesh, arg_shapes):
    """Per-operand and per-result shardings: each state's history's leading spec."""
    g, kinds = _layout(params)
    lead = [_padded_spec(arg_shapes[i].sharding, arg_shapes[i].ndim)[:-1] for i in range(g)]
    hist = [NamedSharding(mesh, PartitionSpec(*lead[i], None)) for i in range(g)]
    small = [NamedSharding(mesh, PartitionSpec(*lead[i])) for i in range(g)]
    args = [hist[k % g] if kind == "history" else small[k % g] for k, kind in enumerate(kinds)]
    return tuple(args), tuple(hist + small + small)


UPDATE = base.Partitioning(shardings=_shardings, rule=_sharding_rule)


