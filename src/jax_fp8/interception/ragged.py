"""The interception of ``jax.lax.ragged_dot`` and ``jax.lax.ragged_dot_general`` (a
mixture-of-experts layer's grouped GEMM) for the model converters, beside
`jax_fp8.interception`'s ``dot_general`` / ``einsum`` / matrix products.

While a converted model runs, a ``jax.lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes)``
of a matched module whose rhs is one of the module's parameters (an expert weight, followed
as a dense GEMM's weight is) goes to the site's converter as the GEMM kind ``"ragged_dot"``
with ``args = (lhs, rhs, group_sizes)``: the converter runs `jax_fp8.fp8_ragged_dot` with
that weight's FP8 state (one state per expert, leading axis G). A ``ragged_dot_general`` in
the same form, or with the expert weight laid out [G, N, K], goes there too (the weight's
last two axes swapped, as `jax_fp8.fp8_ragged_dot_general` swaps them). A grouped GEMM of a
matched module left as it is for a reason the user can act on (an expert weight changed
before the GEMM, so not followed; a dtype the grouped FP8 GEMM does not take; another form)
is reported as `jax_fp8.interception` reports a dense one; one of two activations, or with a
``group_offset``, goes to the original function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from jax_fp8 import interception
from jax_fp8.interception._follow import _FLOATS

__all__ = ["ORIGINAL_RAGGED_DOT", "ORIGINAL_RAGGED_DOT_GENERAL", "expert_weight"]

# The functions found at import; a call left alone goes to `interception.through`'s (those
# installed when the conversion began).
ORIGINAL_RAGGED_DOT = jax.lax.ragged_dot
ORIGINAL_RAGGED_DOT_GENERAL = jax.lax.ragged_dot_general


def expert_weight(site: interception.Site, lhs: Any,
                  rhs: Any) -> tuple[str | None, str | None]:
    """``(name, None)``: ``rhs`` is the module's parameter ``name`` (an expert weight
    [G, K, N] multiplied by lhs [M, K]), convert; or ``(None, scope)``: leave the grouped
    GEMM alone, reported for the reason `interception.KEPT_SCOPES` ``scope`` gives (None:
    not reported, e.g. two activations)."""
    if not all(hasattr(x, "dtype") for x in (lhs, rhs)) or np.ndim(lhs) != 2 \
            or np.ndim(rhs) != 3:
        return None, None
    dtypes = {np.dtype(x.dtype) for x in (lhs, rhs)}
    if not all(np.issubdtype(d, np.floating) for d in dtypes):
        return None, None
    name = interception.weight_of(site, rhs)
    if name is None:
        weights = any(getattr(w, "ndim", 0) >= 3 for _, w in site.weights)
        return None, "fp8_model_no_weight" if weights else None
    if not dtypes <= _FLOATS:
        return None, "fp8_model_dtype"
    return name, None


def _convert(kind: str, site: interception.Site, lhs: Any, rhs: Any, group_sizes: Any,
             precision: Any, preferred_element_type: Any, original: Callable[[], Any],
             swap: bool = False) -> Any:
    """The grouped GEMM of ``site``'s module: converted, reported or left alone."""
    weight, scope = expert_weight(site, lhs, rhs)
    if weight is None:
        return original() if scope is None else interception._kept(  # noqa: SLF001
            site, scope, kind, lhs, rhs, original)
    scope = interception.check_body(site, rhs)
    if scope is not None:
        return interception._kept(site, scope, kind, lhs, rhs, original)  # noqa: SLF001
    if swap:   # [G, N, K]: the expert weight's last two axes in fp8_ragged_dot's order
        rhs = lax.transpose(rhs, (0, 2, 1))
    interception.note_gemm(site, kind, lhs, rhs)
    with interception.running(None):
        return site.convert("ragged_dot", (lhs, rhs, group_sizes), precision,
                            preferred_element_type, weight)


def _converting_ragged_dot(lhs: Any, rhs: Any, group_sizes: Any, precision: Any = None,
                           preferred_element_type: Any = None, group_offset: Any = None,
                           **kwargs: Any) -> Any:
    def original() -> Any:
        return interception.through(jax.lax, "ragged_dot")(
            lhs, rhs, group_sizes, precision=precision,
            preferred_element_type=preferred_element_type, group_offset=group_offset,
            **kwargs)

    site = interception._innermost()  # noqa: SLF001
    if site is None or group_offset is not None or kwargs:
        return original()
    return _convert("ragged_dot", site, lhs, rhs, group_sizes, precision,
                    preferred_element_type, original)


# The dimension numbers of a mixture-of-experts layer's grouped GEMM (those of ragged_dot,
# its expert weight [G, K, N] or [G, N, K]), as `jax_fp8.fp8_ragged_dot_general` takes them.
def _moe_form(numbers: Any, lhs: Any, rhs: Any) -> tuple[bool, bool]:
    """(is the mixture-of-experts form, with the weight laid out [G, N, K])."""
    try:
        (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
        form = (tuple(lc), tuple(lb), tuple(rb), tuple(numbers.lhs_ragged_dimensions),
                tuple(numbers.rhs_group_dimensions))
        rc = tuple(int(a) for a in rc)
    except (AttributeError, TypeError, ValueError):
        return False, False
    ok = (np.ndim(lhs) == 2 and np.ndim(rhs) == 3 and form == ((1,), (), (), (0,), (0,))
          and rc in ((1,), (2,)))
    return ok, rc == (2,)


def _converting_ragged_dot_general(lhs: Any, rhs: Any, group_sizes: Any,
                                   ragged_dot_dimension_numbers: Any, precision: Any = None,
                                   preferred_element_type: Any = None,
                                   group_offset: Any = None, **kwargs: Any) -> Any:
    def original() -> Any:
        return interception.through(jax.lax, "ragged_dot_general")(
            lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type, group_offset=group_offset,
            **kwargs)

    site = interception._innermost()  # noqa: SLF001
    if site is None or group_offset is not None or kwargs:
        return original()
    moe, swap = _moe_form(ragged_dot_dimension_numbers, lhs, rhs)
    if not moe:
        weight = None
        if all(hasattr(x, "dtype") for x in (lhs, rhs)):
            weight = interception.weight_of(site, rhs) or interception.weight_of(site, lhs)
        if weight is None:
            return original()
        return interception._kept(site, "fp8_model_form", "ragged_dot_general",  # noqa: SLF001
                                  lhs, rhs, original)
    return _convert("ragged_dot_general", site, lhs, rhs, group_sizes, precision,
                    preferred_element_type, original, swap=swap)


interception.PATCHES.append((jax.lax, "ragged_dot", _converting_ragged_dot))
interception.PATCHES.append((jax.lax, "ragged_dot_general", _converting_ragged_dot_general))
