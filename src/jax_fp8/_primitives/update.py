"""The `jax_fp8_update` primitive: abstract eval, batching, JVP and lowering.

One bind updates G states. Operands (flat): G histories [..., L_i], G scales [...],
then G scale_invs if `has_scale_inv`, then G amaxes if `has_amax`. Results: G
histories, G scales, G scale_invs. With `in_place`, history and scale results (and
scale_inv, when it is an operand) alias their operands, so a donated state is updated
in place; without, the results are new buffers (for calls on thousands of arrays).

Lowering: the FFI custom call on CPU and CUDA when the kernel was built, the
jax.numpy fallback elsewhere (or when `implementation="jnp"`). Under a
multi-device jit the custom call is wrapped in `custom_partitioning`, so each
device updates the shards it holds (leading axes are independent tensors).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp8 import _registration
from jax_fp8._primitives import common, jnp_update, partition

fp8_update_p = Primitive("jax_fp8_update")
fp8_update_p.multiple_results = True
partition.require_devices_during_lowering(fp8_update_p)

ALGOS = {"max": 0, "most_recent": 1}
# "auto": the kernel where built (partitioned under a multi-device jit), else jnp;
# "jnp": always the jax.numpy version; "local": the bare custom call (used inside
# the partitioned lowering for each device's shards).
IMPLEMENTATIONS = ("auto", "jnp", "local")


def split_operands(operands, num_states, has_scale_inv, has_amax):
    """Flat operands -> (histories, scales, scale_invs | None, amaxes | None)."""
    g = num_states
    histories, scales = list(operands[:g]), list(operands[g:2 * g])
    rest = list(operands[2 * g:])
    scale_invs = rest[:g] if has_scale_inv else None
    amaxes = rest[-g:] if has_amax else None
    return histories, scales, scale_invs, amaxes


def _abstract_eval(*avals, scaled_max, amax_compute_algo, power_of_2_scale, skip_unused,
                   has_scale_inv, has_amax, in_place, implementation):
    del amax_compute_algo, power_of_2_scale, skip_unused, in_place, implementation
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
    common.check_same_varying("jax_fp8_update", avals)
    return [a.update(weak_type=False) for a in histories + scales + scales]


fp8_update_p.def_abstract_eval(_abstract_eval)


def _impl_jnp(*operands, scaled_max, amax_compute_algo, power_of_2_scale, skip_unused,
              has_scale_inv, has_amax, in_place, implementation):
    del in_place, implementation
    histories, scales, _, amaxes = split_operands(operands, len(scaled_max), has_scale_inv,
                                                  has_amax)
    h, s, si = jnp_update.update_many(histories, scales, amaxes, scaled_max=scaled_max,
                                       amax_compute_algo=amax_compute_algo,
                                       power_of_2_scale=power_of_2_scale,
                                       skip_unused=skip_unused)
    return [*h, *s, *si]


def _ffi_attributes(scaled_max, amax_compute_algo, power_of_2_scale, skip_unused,
                    has_scale_inv, has_amax, in_place):
    return dict(scaled_max=np.asarray(scaled_max, dtype=np.float32),
                amax_compute_algo=np.int32(amax_compute_algo),
                power_of_2_scale=np.bool_(power_of_2_scale),
                skip_unused=np.bool_(skip_unused),
                has_scale_inv=np.bool_(has_scale_inv),
                has_amax=np.bool_(has_amax),
                in_place=np.bool_(in_place))


def ffi_call_lowering(ctx, *operands, scaled_max, amax_compute_algo, power_of_2_scale,
                      skip_unused, has_scale_inv, has_amax, in_place):
    """The bare custom call (what each device runs on its own shards). In place, every
    state result aliases its operand; out of place none does (XLA's compile time grows
    superlinearly with the number of aliased operands of one custom call)."""
    g = len(scaled_max)
    n_aliased = g * (3 if has_scale_inv else 2) if in_place else 0
    rule = jax.ffi.ffi_lowering(_registration.FFI_TARGET,
                                operand_output_aliases={i: i for i in range(n_aliased)})
    return rule(ctx, *operands, **_ffi_attributes(scaled_max, amax_compute_algo,
                                                  power_of_2_scale, skip_unused,
                                                  has_scale_inv, has_amax, in_place))


_jnp_lowering = mlir.lower_fun(_impl_jnp, multiple_results=True)


def _lowering(ctx, *operands, implementation, **params):
    if implementation == "jnp":
        return _jnp_lowering(ctx, *operands, implementation=implementation, **params)
    if implementation == "auto" and partition.needs_partitioning(ctx):
        return partition.partitioned_lowering(fp8_update_p, ctx, *operands, **params)
    return ffi_call_lowering(ctx, *operands, **params)


mlir.register_lowering(fp8_update_p, _jnp_lowering)  # any platform without a kernel
if _registration.HAS_CPU_KERNEL:
    mlir.register_lowering(fp8_update_p, _lowering, platform="cpu")
if _registration.HAS_CUDA_KERNEL:
    mlir.register_lowering(fp8_update_p, _lowering, platform="cuda")


# Eager calls compile the one-primitive program once per static configuration.
fp8_update_p.def_impl(common.eager_impl(fp8_update_p))


def _batching_rule(args, dims, **params):
    # Leading axes are independent tensors: put the vmapped axis in front of every
    # operand (broadcasting unbatched ones) and run one update on the bigger stack.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    outs = fp8_update_p.bind(*args, **params)
    return outs, [0] * len(outs)


batching.primitive_batchers[fp8_update_p] = _batching_rule


def _jvp_rule(primals, tangents, **params):
    # The FP8 state is bookkeeping, not a function to differentiate: zero tangents.
    del tangents
    outs = fp8_update_p.bind(*primals, **params)
    return outs, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]


ad.primitive_jvps[fp8_update_p] = _jvp_rule
