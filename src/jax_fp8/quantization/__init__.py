"""Per-tensor FP8 quantization: ``x_fp8 = saturate_cast(x * scale)``, ``x ~= x_fp8 * scale_inv``.

The convention and the exact arithmetic are in ``docs/semantics.md`` (section
"Quantization").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import amax as amax_lib
from jax_fp8.state import ScalingState

__all__ = ["compute_amax", "dequantize", "quantize"]


def compute_amax(x: ArrayLike) -> jax.Array:
    """``max |x|`` over the whole tensor as a float32 scalar (0 for an empty tensor).

    NaN propagates on the GPU (XLA's vectorized CPU max can drop a NaN among many
    values). Under a multi-device ``jit`` it is one max over all devices, so a step's
    amaxes share one all-reduce (see ``jax_fp8/_primitives/amax.py``).
    """
    x = jnp.asarray(x)
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    return amax_lib.amax(x)


def broadcast_to_leading(s: ArrayLike, ndim: int) -> jax.Array:
    """A per-tensor factor of shape ``[...]`` (leading axes of x) as ``[..., 1, 1, ...]``."""
    s = jnp.asarray(s)
    if s.ndim > ndim:
        raise ValueError(f"state has shape {s.shape} but the tensor has only {ndim} axes")
    return s.reshape(s.shape + (1,) * (ndim - s.ndim))


def quantize(x: ArrayLike, state: ScalingState) -> jax.Array:
    """Saturating cast of ``x * state.scale`` to ``state.fp8_dtype``.

    Computed in float32: ``clip(x * scale, -fp8_max, fp8_max).astype(fp8_dtype)``. Values
    beyond the range (infinities included) saturate to ``+-fp8_max``; NaN stays NaN (also
    for E4M3, which has a NaN but no infinity). A state with leading axes ``[...]`` scales
    the matching leading axes of ``x``.

    Example:

        st = ScalingState.create()                       # scale 1, E4M3
        quantize(jnp.array([1.0, 500.0]), st)            # -> [1, 448] as float8_e4m3fn
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got {x.dtype}")
    dtype = state.fp8_dtype
    fmax = np.float32(recipe_lib.fp8_max(dtype))
    y = x.astype(jnp.float32) * broadcast_to_leading(state.scale.astype(jnp.float32), x.ndim)
    return jnp.clip(y, -fmax, fmax).astype(dtype)


def dequantize(q: ArrayLike, state: ScalingState, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """``q * state.scale_inv`` in float32, cast to ``dtype``."""
    q = jnp.asarray(q)
    y = q.astype(jnp.float32) * broadcast_to_leading(state.scale_inv.astype(jnp.float32),
                                                     q.ndim)
    return y.astype(dtype)
