"""The update in plain jax.numpy: the fallback on platforms with no kernel.

Same bits as the kernels (scaling_math.h) except where XLA flushes subnormals to
zero in its own float32 arithmetic (docs/semantics.md): a subnormal amax, scale or result.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_FLT_MAX = np.float32(np.finfo(np.float32).max)


def fmax_num(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE maximumNumber: NaN ignored, +0 > -0 (scaling_math.h's fmax_num)."""
    a_wins = jnp.isnan(b) | (a > b) | ((a == b) & ~jnp.signbit(a))
    return jnp.where(jnp.isnan(a), b, jnp.where(a_wins, a, b))


def update_one(history: jax.Array, scale: jax.Array, amax: jax.Array | None, *,
               scaled_max: float, algo: int, power_of_2_scale: bool,
               skip_unused: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One state: history [..., L], scale [...], amax [...] or None -> 3 arrays."""
    h0 = history[..., 0] if amax is None else fmax_num(history[..., 0], amax)
    if algo == 0:  # "max": fmax over {0, h0, h[1..L-1]}; NaN is neutral like 0
        rest = jnp.max(jnp.where(jnp.isnan(history[..., 1:]), 0.0, history[..., 1:]),
                       axis=-1, initial=0.0)
        a = jnp.maximum(rest, jnp.where(jnp.isnan(h0), 0.0, h0))
    else:  # "most_recent"
        a = h0
    s = jnp.where(jnp.isfinite(a) & (a > 0), np.float32(scaled_max) / a, scale)
    s = jnp.where(jnp.isinf(s), _FLT_MAX, s)
    if power_of_2_scale:
        bits = lax.bitcast_convert_type(s, jnp.uint32) & np.uint32(0xFF800000)
        s = lax.bitcast_convert_type(bits, jnp.float32)
    zero = jnp.zeros_like(history[..., :1])
    if history.shape[-1] == 1:
        new_history = zero
    else:
        new_history = jnp.concatenate([zero, history[..., 2:], h0[..., None]], axis=-1)
    if skip_unused:
        unused = h0 == 0
        new_history = jnp.where(unused[..., None], history, new_history)
        s = jnp.where(unused, scale, s)
    return new_history, s, reciprocal(s)


def reciprocal(s: jax.Array) -> jax.Array:
    """1 / s as XLA divides (the update's jnp fallback; subnormal results may flush, as
    docs/semantics.md says); a NaN s gives that NaN quieted, as scaling_math.h's
    scale_inverse does. The kernels' exact 1 / scale is `exact.scale_inverse`."""
    quiet = lax.bitcast_convert_type(
        lax.bitcast_convert_type(s, jnp.uint32) | np.uint32(0x00400000), jnp.float32)
    return jnp.where(jnp.isnan(s), quiet, np.float32(1.0) / s)


def update_many(histories: Sequence[jax.Array], scales: Sequence[jax.Array],
                amaxes: Sequence[jax.Array] | None, *, scaled_max: Sequence[float],
                amax_compute_algo: int, power_of_2_scale: bool, skip_unused: bool,
                ) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
    """All states of one call; amaxes is None or a list like scales."""
    outs = [update_one(h, s, None if amaxes is None else amaxes[i], scaled_max=scaled_max[i],
                       algo=amax_compute_algo, power_of_2_scale=power_of_2_scale,
                       skip_unused=skip_unused)
            for i, (h, s) in enumerate(zip(histories, scales))]
    return [o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs]
