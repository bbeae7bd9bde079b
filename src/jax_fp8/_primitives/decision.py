"""The one decision of which lowering a jax_fp8 primitive gets, and why.

`decide` reads a primitive's `Spec` (implementation, `Spec.reference_where`, its kernel's
`refuses` and `supports`, its partitioning) for operands, a platform and the devices a jit
runs over; lowering asks it through `choose`, ``jax_fp8.devtools.explain`` for a whole
program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax_fp8 import _registration
from jax_fp8._primitives.spec import (
    DEFAULT,
    ENV,
    KERNEL,
    PARTITIONED,
    PER_DEVICE,
    REFERENCE,
    Spec,
)


def partition_devices(ctx: Any) -> int:
    """The devices a jit being lowered runs over (1 inside shard_map or pmap, and when
    lowering for ``jax.export``: custom_partitioning runs a Python callback inside XLA's
    partitioner, which a serialized program cannot carry; there the bare custom call is
    emitted and XLA's partitioner gathers its (small) operands instead: same bits)."""
    params = getattr(ctx.module_context, "lowering_parameters", None)
    if getattr(params, "for_export", False):
        return 1
    return getattr(ctx.module_context.axis_context, "num_devices", 1)


def needs_partitioning(ctx: Any) -> bool:
    """True under a jit over several devices (`partition_devices`)."""
    return partition_devices(ctx) > 1


def decide(spec: Spec, platform: str | None, avals: Sequence[Any], implementation: str,
           params: dict[str, Any], num_devices: int = 1) -> tuple[str, str]:
    """Which lowering of `spec` runs on `platform` (None: one without a kernel) for
    operands `avals` under a jit over `num_devices` devices, and why: (`KERNEL`,
    `PARTITIONED` or `REFERENCE`, the reason in words)."""
    if implementation == "jnp":
        return REFERENCE, jnp_reason()
    forced = spec.reference_where(*avals, **params)
    if forced:
        return REFERENCE, forced
    kernel = None if platform is None else spec.kernels.get(platform)
    if kernel is None:
        no_kernel = f"no {platform or 'such'} kernel"
    elif not _registration.has_kernel(spec.name, platform):
        kernel, no_kernel = None, f"the {platform} kernel is not built in this process"
    if implementation != PER_DEVICE and num_devices > 1:
        part = spec.partitioning
        if part is None:
            return REFERENCE, (f"a jit over {num_devices} devices and no partitioning rule: "
                               "XLA partitions the reference")
        if kernel is None and part.needs_kernel:
            return REFERENCE, (f"a jit over {num_devices} devices and {no_kernel}: XLA "
                               "partitions the reference")
        if not part.supports(*avals, **params):
            return REFERENCE, (f"a jit over {num_devices} devices; the partitioning rule "
                               "does not take these operands: XLA partitions the reference")
        what = "the kernel" if kernel is not None else "the reference"
        return PARTITIONED, f"a jit over {num_devices} devices: each runs {what} on its shards"
    if kernel is None:
        return REFERENCE, no_kernel
    refused = kernel.refuses(*avals, **params)
    if refused:
        return REFERENCE, refused
    if not kernel.supports(*avals, **params):
        return REFERENCE, f"the {platform} kernel does not take these operands"
    return KERNEL, f"the {platform} kernel"


def jnp_reason() -> str:
    """The reason given where ``implementation="jnp"`` (naming the environment switch)."""
    return "implementation='jnp'" + (f" ({ENV}=jnp)" if DEFAULT == "jnp" else "")


def choose(spec: Spec, platform: str | None, ctx: Any, implementation: str,
           params: dict[str, Any]) -> str:
    """Which lowering of `spec` runs on `platform` in lowering context `ctx` (`decide`)."""
    return decide(spec, platform, ctx.avals_in, implementation, params,
                  partition_devices(ctx))[0]
