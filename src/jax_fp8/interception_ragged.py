"""The interception of ``jax.lax.ragged_dot`` (a mixture-of-experts layer's grouped GEMM) for the
model converters, beside `jax_fp8.interception`'s ``dot_general`` / ``einsum``.

While a converted model runs, a ``jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes)``
of a matched module whose rhs is one of the module's parameters (an expert weight, followed
as a dense GEMM's weight is) goes to the site's converter as the GEMM kind ``"ragged_dot"``
with ``args = (lhs, rhs, group_sizes)``: the converter runs `jax_fp8.fp8_ragged_dot` with
that weight's FP8 state (one state per expert, leading axis G). Any other ``ragged_dot``
(two activations, another layout, a ``group_offset``) goes to the original function.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_fp8 import interception

__all__ = ["ORIGINAL_RAGGED_DOT", "expert_weight"]

ORIGINAL_RAGGED_DOT = jax.lax.ragged_dot


def expert_weight(site: interception.Site, lhs, rhs) -> str | None:
    """The name of the module's parameter that ``rhs`` is (an expert weight [G, K, N]
    multiplied by lhs [M, K]), or None: leave the ragged_dot alone."""
    for x in (lhs, rhs):
        if not hasattr(x, "dtype") or np.dtype(x.dtype) not in interception._FLOATS:  # noqa: SLF001
            return None
    if np.ndim(lhs) != 2 or np.ndim(rhs) != 3:
        return None
    return interception.weight_of(site, rhs)


def _converting_ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                           group_offset=None, **kwargs):
    site = interception._innermost()  # noqa: SLF001
    weight = None
    if site is not None and group_offset is None and not kwargs:
        weight = expert_weight(site, lhs, rhs)
    if site is None or weight is None:
        return ORIGINAL_RAGGED_DOT(lhs, rhs, group_sizes, precision=precision,
                                   preferred_element_type=preferred_element_type,
                                   group_offset=group_offset, **kwargs)
    with interception.running(None):
        return site.convert("ragged_dot", (lhs, rhs, group_sizes), precision,
                            preferred_element_type, weight)


interception.PATCHES.append((jax.lax, "ragged_dot", _converting_ragged_dot))
