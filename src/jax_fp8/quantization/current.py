"""Per-tensor current scaling: one scale per tensor from its own amax, and the scale arithmetic
(Transformer Engine's ``compute_scale_from_amax``) that blockwise scaling shares.

``quantize_current`` takes its amax from ``jax_fp8.compute_amax``: one max over all
devices under a multi-device jit, XLA's own max elsewhere. Unlike a block's, that amax
may read a subnormal maximum as 0 (XLA:CPU flushes subnormals), and a NaN in x makes it
NaN on the GPU (scale 1) where XLA's vectorized CPU max may drop it; the scale
arithmetic after it is the exact one (docs/semantics.md, "Scale from an amax").
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import quantization, recipe as recipe_lib
from jax_fp8._primitives import base, block_quantize as bq

__all__ = ["quantize_current", "scale_from_amax", "scale_inverse"]


def _options(fp8_dtype: DTypeLike, power_of_2_scale: Any, amax_epsilon: Any) -> dict[str, Any]:
    if not isinstance(power_of_2_scale, (bool, np.bool_)):
        raise TypeError(f"power_of_2_scale must be a bool, got {power_of_2_scale!r}")
    recipe_lib._check_epsilon(amax_epsilon)
    return dict(fp8_dtype=recipe_lib.canonical_fp8_dtype(fp8_dtype),
                power_of_2_scale=bool(power_of_2_scale), amax_epsilon=float(amax_epsilon))


def _operand(x: ArrayLike, min_ndim: int = 2) -> jax.Array:
    x = jnp.asarray(x)
    if np.dtype(x.dtype) not in bq.INPUT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim < min_ndim:
        raise ValueError(f"x must be laid out as [..., M, K] (rank >= 2), got shape {x.shape}; "
                         f"a vector v is x = v[None, :]")
    return x


def scale_from_amax(amax: ArrayLike, fp8_dtype: DTypeLike = jnp.float8_e4m3fn, *,
                    power_of_2_scale: bool = False, amax_epsilon: float = 0.0) -> jax.Array:
    """The quantization scale ``s`` (``x_fp8 = saturate_cast(x * s)``) from an amax.

    docs/semantics.md / TE's ``compute_scale_from_amax``, elementwise over a float32 amax of any
    shape: ``amax < amax_epsilon`` is raised to it; an amax of 0, inf or NaN gives 1;
    otherwise ``fp8_max / amax`` (correctly rounded), FLT_MAX where that overflows; with
    ``power_of_2_scale`` rounded down to a power of two. Exact IEEE float32, subnormal
    amaxes included (their scale is FLT_MAX). ``scale_inverse(s)`` is the matching scale_inv.
    """
    opts = _options(fp8_dtype, power_of_2_scale, amax_epsilon)
    amax = jnp.asarray(amax)
    if not jnp.issubdtype(amax.dtype, jnp.floating):
        raise TypeError(f"amax must be a floating array, got {amax.dtype}")
    return bq.scale_from_amax_f32(amax.astype(jnp.float32), recipe_lib.fp8_max(opts["fp8_dtype"]),
                                  opts["amax_epsilon"], opts["power_of_2_scale"])


def scale_inverse(scale: ArrayLike) -> jax.Array:
    """``1 / scale`` in float32, correctly rounded also where it is subnormal."""
    return bq.scale_inverse(jnp.asarray(scale, jnp.float32))


def quantize_current(x: ArrayLike, fp8_dtype: DTypeLike = jnp.float8_e4m3fn, *,
                     power_of_2_scale: bool = False,
                     amax_epsilon: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Per-tensor current scaling: (x_fp8 [...], scale_inv float32 []) from max |x|.

    The amax is ``jax_fp8.compute_amax(x)`` (under a multi-device jit one max over all
    devices, so every device quantizes with the global scale), then ``scale_from_amax``
    and the same cast as ``quantize_blocks``. Not differentiated (a zero gradient).
    """
    x = jax.lax.stop_gradient(_operand(x, min_ndim=0))
    opts = _options(fp8_dtype, power_of_2_scale, amax_epsilon)
    amax = quantization.compute_amax(x)
    # one compiled program also when eager (as the primitives)
    return cast("tuple[jax.Array, jax.Array]", base.compiled_call(_cast_current, x, amax, **opts))


def _cast_current(x: jax.Array, amax: jax.Array, *, fp8_dtype: np.dtype,
                  power_of_2_scale: bool, amax_epsilon: float) -> tuple[jax.Array, jax.Array]:
    scale = bq.scale_from_amax_f32(amax, recipe_lib.fp8_max(fp8_dtype), amax_epsilon,
                                   power_of_2_scale)
    return bq.cast_scaled(bq.widen(x), scale, fp8_dtype), bq.scale_inverse(scale)
