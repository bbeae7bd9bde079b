"""The `jax_fp8_update` primitive: the delayed-scaling update of many FP8 states in one call.

Operands (G states): amax_history[0..G), scale[0..G), then scale_inv[0..G) if
``has_scale_inv`` and amax[0..G) if ``has_amax`` (folded into history[..., 0] first);
results: the new histories, scales and scale_invs (docs/semantics.md, "The
delayed-scaling update"). With ``in_place`` the state results alias their operands,
updated in place; without, the results are new buffers.

The kernel (ffi/update_cpu.cc, ffi/update_cuda.cu) where built, partitioned per device
under a jit over several devices (`PARTITIONING`); the jax.numpy reference (jnp_update.py)
elsewhere and for ``implementation="jnp"``.

Sharded states: each device updates the shards it holds, with no all-gather. Every leading
(non-history) axis of a state indexes independent tensors, so the update partitions
trivially along them; only the history axis must be whole on a device. `PARTITIONING` says
exactly that to custom_partitioning (base.Partitioning): each state gets its own leading
factors (passed through to its results) and a history factor that needs replication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_fp8._primitives import base, jnp_update, partition_specs as specs

ALGOS = {"max": 0, "most_recent": 1}
IMPLEMENTATIONS = base.IMPLEMENTATIONS
TARGET = "jax_fp8_update"


def split_operands(operands: Sequence[Any], num_states: int, has_scale_inv: bool,
                   has_amax: bool) -> tuple[list[Any], list[Any], list[Any] | None,
                                            list[Any] | None]:
    """Flat operands -> (histories, scales, scale_invs | None, amaxes | None)."""
    g = num_states
    histories, scales = list(operands[:g]), list(operands[g:2 * g])
    rest = list(operands[2 * g:])
    scale_invs = rest[:g] if has_scale_inv else None
    amaxes = rest[-g:] if has_amax else None
    return histories, scales, scale_invs, amaxes


def _abstract_eval(*avals: Any, scaled_max: tuple[float, ...], amax_compute_algo: int,
                   power_of_2_scale: bool, skip_unused: bool, has_scale_inv: bool,
                   has_amax: bool, in_place: bool) -> list[Any]:
    del amax_compute_algo, power_of_2_scale, skip_unused, in_place
    g = len(scaled_max)
    want = g * (2 + has_scale_inv + has_amax)
    if len(avals) != want:
        raise ValueError(f"jax_fp8_update: expected {want} operands for {g} states, "
                         f"got {len(avals)}")
    histories, scales, scale_invs, amaxes = split_operands(avals, g, has_scale_inv, has_amax)
    for i, (h, s) in enumerate(zip(histories, scales)):
        others = {"scale": s}
        if scale_invs is not None:
            others["scale_inv"] = scale_invs[i]
        if amaxes is not None:
            others["amax"] = amaxes[i]
        for name, aval in [("amax_history", h), *others.items()]:
            if aval.dtype != np.float32:
                raise TypeError(f"jax_fp8_update: state {i}: {name} must be float32, "
                                f"got {aval.dtype}")
        if h.ndim < 1 or h.shape[-1] < 1:
            raise ValueError(f"jax_fp8_update: state {i}: amax_history must have a last "
                             f"(history) axis of length >= 1, got shape {h.shape}")
        for name, aval in others.items():
            if aval.shape != h.shape[:-1]:
                raise ValueError(f"jax_fp8_update: state {i}: {name} shape {aval.shape} "
                                 f"must equal amax_history.shape[:-1] = {h.shape[:-1]}")
    return [a.update(weak_type=False) for a in histories + scales + scales]


def _reference(*operands: jax.Array, scaled_max: tuple[float, ...], amax_compute_algo: int,
               power_of_2_scale: bool, skip_unused: bool, has_scale_inv: bool,
               has_amax: bool, in_place: bool) -> list[jax.Array]:
    del in_place
    histories, scales, _, amaxes = split_operands(operands, len(scaled_max), has_scale_inv,
                                                  has_amax)
    h, s, si = jnp_update.update_many(histories, scales, amaxes, scaled_max=scaled_max,
                                       amax_compute_algo=amax_compute_algo,
                                       power_of_2_scale=power_of_2_scale,
                                       skip_unused=skip_unused)
    return [*h, *s, *si]


def _ffi_attributes(scaled_max: tuple[float, ...], amax_compute_algo: int,
                    power_of_2_scale: bool, skip_unused: bool, has_scale_inv: bool,
                    has_amax: bool, in_place: bool) -> dict[str, Any]:
    return dict(scaled_max=np.asarray(scaled_max, dtype=np.float32),
                amax_compute_algo=np.int32(amax_compute_algo),
                power_of_2_scale=np.bool_(power_of_2_scale),
                skip_unused=np.bool_(skip_unused),
                has_scale_inv=np.bool_(has_scale_inv),
                has_amax=np.bool_(has_amax),
                in_place=np.bool_(in_place))


def _kernel_lowering(ctx: Any, *operands: Any, scaled_max: tuple[float, ...],
                     amax_compute_algo: int, power_of_2_scale: bool, skip_unused: bool,
                     has_scale_inv: bool, has_amax: bool, in_place: bool) -> Any:
    """The bare custom call (what each device runs on its own shards). In place, every
    state result aliases its operand; out of place none does (XLA's compile time grows
    superlinearly with the number of aliased operands of one custom call)."""
    g = len(scaled_max)
    n_aliased = g * (3 if has_scale_inv else 2) if in_place else 0
    rule = jax.ffi.ffi_lowering(TARGET, operand_output_aliases={i: i for i in range(n_aliased)})
    return rule(ctx, *operands, **_ffi_attributes(scaled_max, amax_compute_algo,
                                                  power_of_2_scale, skip_unused,
                                                  has_scale_inv, has_amax, in_place))


# ----------------------------------------------------------------------- partitioning

def _layout(params: dict[str, Any]) -> tuple[int, list[str]]:
    """(num_states, operand kinds) of a flat operand list."""
    g = len(params["scaled_max"])
    kinds = ["history"] * g + ["scale"] * g
    kinds += ["scale_inv"] * g if params["has_scale_inv"] else []
    kinds += ["amax"] * g if params["has_amax"] else []
    return g, kinds


def _sharding_rule(params: dict[str, Any], operand_types: Sequence[Any],
                   ) -> tuple[str, dict[str, Any]]:
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


def _shardings(params: dict[str, Any], mesh: jax.sharding.Mesh, arg_shapes: Sequence[Any],
               ) -> tuple[tuple[NamedSharding, ...], tuple[NamedSharding, ...]]:
    """Per-operand and per-result shardings: each state's history's leading spec."""
    g, kinds = _layout(params)
    lead = [specs.padded_spec(arg_shapes[i].sharding, arg_shapes[i].ndim)[:-1]
            for i in range(g)]
    # PartitionSpec's constructor is unannotated in JAX.
    hist = [NamedSharding(mesh, PartitionSpec(*lead[i], None)) for i in range(g)]  # type: ignore[no-untyped-call]
    small = [NamedSharding(mesh, PartitionSpec(*lead[i])) for i in range(g)]  # type: ignore[no-untyped-call]
    args = [hist[k % g] if kind == "history" else small[k % g] for k, kind in enumerate(kinds)]
    return tuple(args), tuple(hist + small + small)


PARTITIONING = base.Partitioning(shardings=_shardings, rule=_sharding_rule)

_KERNEL = base.Kernel(_kernel_lowering)
# Inside shard_map the results vary over every manual axis any operand varies over.
fp8_update_p = base.register(base.Spec(
    TARGET, _abstract_eval, _reference, kernels={"cpu": _KERNEL, "cuda": _KERNEL},
    multiple_results=True, partitioning=PARTITIONING, same_varying=True))
