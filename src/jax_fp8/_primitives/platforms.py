"""Computations in XLA ops with a version per platform and no kernel (`ByPlatform`).

The FP8 GEMM's accumulation, named as a dot algorithm only on CUDA, is one: `by_platform`
makes it a function whose version is chosen where it is lowered, `decide_platform` says
which and why (``jax_fp8.devtools.explain`` reports it), and ``JAX_FP8_IMPLEMENTATION=jnp``
makes it the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
from jax import lax

from jax_fp8._primitives.decision import jnp_reason
from jax_fp8._primitives.spec import DEFAULT, REFERENCE, SPECS, static_params

VARIANT = "variant"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One platform's version of a `ByPlatform` computation: ``fn(*operands, **params)``,
    with the same results (shapes, types) as the reference, and what it does differently,
    in words."""
    fn: Callable[..., Any]
    what: str


@dataclasses.dataclass(frozen=True)
class ByPlatform:
    """A computation in XLA ops (no kernel, so XLA partitions it under any jit) with a
    version per platform.

    name: its name, also that of the jit it runs in (explain finds it by that name).
    reference(*operands, **params): the version of every platform not in `variants`, and
      of every platform under ``JAX_FP8_IMPLEMENTATION=jnp``.
    variants: {platform ("cuda", ...): Variant}.
    """
    name: str
    reference: Callable[..., Any]
    variants: Mapping[str, Variant] = dataclasses.field(default_factory=dict)


BY_PLATFORM: dict[str, ByPlatform] = {}


def decide_platform(choice: ByPlatform, platform: str | None,
                    implementation: str | None = None) -> tuple[str, str]:
    """Which version of `choice` runs on `platform` (None: one of no variant) with
    `implementation` (default `DEFAULT`), and why: (`VARIANT` or `REFERENCE`, the reason
    in words)."""
    if (implementation or DEFAULT) == "jnp":
        return REFERENCE, jnp_reason()
    variant = None if platform is None else choice.variants.get(platform)
    if variant is None:
        return REFERENCE, f"no {platform or 'such'} variant"
    return VARIANT, f"the {platform} variant: {variant.what}"


def device_platform(device: Any) -> str:
    """The platform name lowering uses for `device`: "cuda" or "rocm" for a GPU, else
    its platform ("cpu", "tpu")."""
    if device.platform == "gpu":
        version = str(getattr(device.client, "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return cast(str, device.platform)


def _concrete_platform(x: Any) -> str | None:
    """The platform of a concrete array's device (as code run with jit disabled has);
    None for a tracer or a non-array."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return None
    return device_platform(next(iter(x.devices())))


def by_platform(choice: ByPlatform) -> Callable[..., Any]:
    """`choice` as a function ``run(*operands, **params)``: the version `decide_platform`
    picks for the platform it runs on. `params` are static (hashable); operands may be
    pytrees of arrays.

    Traced operands (in a jit, or under vmap or grad) go through one jit named
    ``choice.name`` whose version is picked where it is lowered (``lax.platform_dependent``):
    in a jit, for the platform that jit is lowered for (each of several, lowered for
    several); for operands outside a jit, their device's. Concrete operands (jit disabled,
    which would run that jit op by op on the default backend) take their device's version
    directly, decided by the first operand.

    Raises:
      ValueError: where a primitive or another ByPlatform has that name.
    """
    if choice.name in BY_PLATFORM or choice.name in SPECS:
        raise ValueError(f"{choice.name} is already registered")
    BY_PLATFORM[choice.name] = choice

    @functools.cache
    def staged(static: tuple[tuple[str, Any], ...]) -> Callable[..., Any]:
        params = dict(static)
        reference = functools.partial(choice.reference, **params)
        variants = {p: functools.partial(v.fn, **params) for p, v in choice.variants.items()}

        def run(*operands: Any) -> Any:
            if DEFAULT == "jnp":
                return reference(*operands)
            return lax.platform_dependent(*operands, default=reference, **variants)

        run.__name__ = run.__qualname__ = choice.name
        return jax.jit(run)

    def call(*operands: Any, **params: Any) -> Any:
        platform = _concrete_platform(operands[0])
        if platform is None:
            return staged(static_params(params))(*operands)
        how, _ = decide_platform(choice, platform)
        fn = choice.variants[platform].fn if how == VARIANT else choice.reference
        return fn(*operands, **params)

    return call
