"""A jax_fp8 primitive's declaration: `Spec`, with its `Kernel` per platform and its
`Partitioning`, the implementations every primitive takes, and the table of declared
primitives (`SPECS`). `base.register` turns a Spec into a JAX primitive; `decision.decide`
reads it to pick a lowering.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from jax_fp8 import _registration

IMPLEMENTATIONS = ("auto", "jnp")
# The one switch that runs the reference everywhere: JAX_FP8_IMPLEMENTATION=jnp in the
# environment (read at import) is the implementation of every primitive bound without one.
ENV = "JAX_FP8_IMPLEMENTATION"
DEFAULT = os.environ.get(ENV, "auto")
if DEFAULT not in IMPLEMENTATIONS:
    raise ValueError(f"{ENV} must be one of {IMPLEMENTATIONS}, got {DEFAULT!r}")
# Inside a partitioned lowering: the kernel on one device's shards, never partitioned again.
PER_DEVICE = "per_device"
REFERENCE, KERNEL, PARTITIONED = "reference", "kernel", "partitioned"


def _always(*avals: Any, **params: Any) -> bool:
    del avals, params
    return True


def _no_reason(*avals: Any, **params: Any) -> None:
    del avals, params
    return None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A custom-call lowering on one platform: ``lower(ctx, *operands, **params)`` emits
    it; ``supports(*avals, **params)`` says whether it applies (else the reference runs);
    ``refuses(*avals, **params)``: None where it may run, else why not, in words (the
    reason `decide` gives: a kernel switched off, or the operands it does not take)."""
    lower: Callable[..., Any]
    supports: Callable[..., Any] = _always
    refuses: Callable[..., Any] = _no_reason


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """custom_partitioning rules for a jit over several devices: each device binds the
    primitive (``PER_DEVICE``) on the shards it holds, then ``combine(results, mesh)``.

    ``shardings(params, mesh, arg_shapes)`` -> (operand shardings, result shardings);
    ``rule(params, operand_types)`` -> (Shardy rule, its keyword arguments);
    ``combine(results, mesh)``: applied to each device's results (e.g. a collective);
    ``local(bind, operands, *, mesh, shardings, params)``: instead of bind + combine,
    each device's whole computation, given ``bind(*operands, **params)`` (the primitive
    on one device) and the operand shardings `shardings` returned;
    ``supports(*avals, **params)``: whether to partition these operands; ``needs_kernel``:
    partition only on platforms with the kernel (elsewhere XLA shards the reference);
    ``explicit``: on meshes with Explicit axes run per device under shard_map with the
    same shardings (else the primitive sees the Explicit-typed operands itself).
    """
    shardings: Callable[..., Any]
    rule: Callable[..., Any]
    combine: Callable[..., Any] | None = None
    supports: Callable[..., Any] = _always
    needs_kernel: bool = True
    local: Callable[..., Any] | None = None
    explicit: bool = False


@dataclasses.dataclass(frozen=True)
class Spec:
    """A primitive's declaration.

    name: the primitive's name, also its FFI target's (ffi/module.cc).
    abstract_eval(*avals, **params): the result avals (checks the operands).
    reference(*operands, **params): the jax.numpy reference.
    reference_lowering(ctx, *operands, **params): an MLIR rule standing for the reference
      where there is none in jax.numpy.
    kernels: {platform ("cpu", "cuda"): Kernel}.
    batch: "leading_axes" (move the batched axis of every operand to the front and bind once:
      for primitives whose leading axes are independent tensors), "reference" (vmap the
      reference) or a batching rule ``(args, dims, **params)``.
    jvp: "zero" (results are not differentiated), "reference" (differentiate the
      reference) or "linear" (with ``transpose(cts, *operands, **params)``).
    partitioning: how it partitions under a jit over several devices, or None.
    same_varying: align the operands' varying manual axes (inside shard_map) at bind,
      and check them in abstract evaluation.
    cache_reference: lower the reference through one jit per parameters, so that many
      same-shaped calls trace it once.
    reference_where(*avals, **params): None, or why these operands get the reference on
      every platform and under any jit (asked by `decide` before kernels and partitioning).
    """
    name: str
    abstract_eval: Callable[..., Any]
    reference: Callable[..., Any] | None = None
    reference_lowering: Callable[..., Any] | None = None
    kernels: Mapping[str, Kernel] = dataclasses.field(default_factory=dict)
    multiple_results: bool = False
    batch: str | Callable[..., Any] = "leading_axes"
    jvp: str = "zero"
    transpose: Callable[..., Any] | None = None
    partitioning: Partitioning | None = None
    same_varying: bool = False
    cache_reference: bool = False
    reference_where: Callable[..., Any] = _no_reason


SPECS: dict[str, Spec] = {}


def kernels_on(platform: str) -> tuple[str, ...]:
    """The primitives whose kernel this process can emit on `platform` ("cpu", "cuda")."""
    return tuple(name for name, spec in SPECS.items()
                 if platform in spec.kernels and _registration.has_kernel(name, platform))


def static_params(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`params` as a hashable key (sorted items): one jit, or one cache entry, per value."""
    return tuple(sorted(params.items()))
