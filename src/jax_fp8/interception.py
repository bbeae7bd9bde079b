"""The interception of GEMM calls that model converters share (framework-neutral).

While a converted model runs (`patched`), ``jax.lax.dot_general`` and ``jax.numpy.einsum``
are replaced by functions that hand a GEMM of a matched module (the innermost `Site`
`running`) to the FP8 GEMM the site's converter creates for it; everything else goes to
the original functions. A framework adapter (``jax_fp8.flax``) says which module is
running and which of its arrays are weights; this module knows no framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import string
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8.rules import Fp8Rule

__all__ = ["ORIGINAL", "Site", "explicit_einsum", "local", "patched", "running"]

ORIGINAL = {"dot_general": jax.lax.dot_general, "einsum": jnp.einsum}
# Further (owner, attribute, replacement) that `patched` installs with the two above (each
# a GEMM function a module of its own intercepts: jax_fp8.interception_ragged's
# jax.lax.ragged_dot).
PATCHES: list[tuple[Any, str, Any]] = []
_FLOATS = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Site:
    """How the GEMMs of one running module method are converted.

    ``convert(kind, args, precision, preferred_element_type, weight)`` runs the FP8 GEMM
    in the module's scope: kind "dot_general" with ``args = (lhs, rhs, dimension_numbers)``
    or "einsum" with ``args = (eqn, lhs, rhs)``, the rhs quantized as the kernel;
    ``weight`` is the name of the module's parameter the rhs is (its FP8 state is that
    weight's), or None (a layer's kernel, or an activation).
    """

    rule: Fp8Rule
    convert: Any
    weights: tuple = ()          # (name, array) of the module's parameters (by identity)
    rhs_is_weight: bool = False  # a layer whose GEMM's rhs is its kernel (nn.Dense, ...)


# This thread's converting call: its Sites (`running`), and what a framework adapter keeps
# for it (the Flax adapter: the parameters its linen modules' ``self.param`` returned).
local = threading.local()
_lock = threading.Lock()
_installed: dict[tuple[int, str], tuple[int, Any]] = {}


def _frames() -> list:
    if not hasattr(local, "frames"):
        local.frames = []
    return local.frames


@contextlib.contextmanager
def running(site):
    """Marks ``site`` (a `Site`, a function returning one or None, or None) as the
    innermost running module method; None: no conversion inside."""
    frames = _frames()
    frames.append(site)
    try:
        yield
    finally:
        frames.pop()


@contextlib.contextmanager
def patched(extra: Sequence[tuple[Any, str, Any]] = ()):
    """Installs the converting ``jax.lax.dot_general`` / ``jax.numpy.einsum`` for the
    duration, and each ``(owner, attribute, replacement)`` of ``extra`` (a framework's own
    hook, e.g. the Flax adapter's recording ``Module.param``). Reference counted per
    attribute over threads: other threads see the original behaviour, since the
    replacements act only where a converted method runs (`running`)."""
    patches = [(jax.lax, "dot_general", _converting_dot_general),
               (jnp, "einsum", _converting_einsum), *PATCHES, *extra]
    with _lock:
        for owner, name, replacement in patches:
            key = (id(owner), name)
            if _installed.get(key, (0, None))[0] == 0:
                _installed[key] = (0, getattr(owner, name))
                setattr(owner, name, replacement)
            count, original = _installed[key]
            _installed[key] = (count + 1, original)
    try:
        yield
    finally:
        with _lock:
            for owner, name, _ in patches:
                key = (id(owner), name)
                count, original = _installed[key]
                if count == 1:
                    setattr(owner, name, original)
                    del _installed[key]
                else:
                    _installed[key] = (count - 1, original)


def _innermost() -> Site | None:
    frames = _frames()
    site = frames[-1] if frames else None
    return site() if callable(site) else site


def _weight_of(site: Site, x) -> str | None:
    return next((name for name, w in site.weights if x is w), None)


def _weight_side(site: Site, lhs, rhs) -> tuple[str, str | None] | None:
    """("rhs" / "lhs", the parameter's name or None): the operand to quantize as the
    kernel and the weight it is; None: leave the GEMM alone."""
    for x in (lhs, rhs):
        if not hasattr(x, "dtype") or np.dtype(x.dtype) not in _FLOATS:
            return None
    if site.rhs_is_weight:
        return "rhs", None
    for side, x in (("rhs", rhs), ("lhs", lhs)):
        name = _weight_of(site, x)
        if name is not None:
            return side, name
    return ("rhs", None) if site.rule.activations else None


def _converting_dot_general(lhs, rhs, dimension_numbers, precision=None,
                            preferred_element_type=None, **kwargs):
    site = _innermost()
    found = None if site is None else _weight_side(site, lhs, rhs)
    if found is None:
        return ORIGINAL["dot_general"](lhs, rhs, dimension_numbers, precision=precision,
                                        preferred_element_type=preferred_element_type,
                                        **kwargs)
    with running(None):
        return _swapped_dot_general(site, *found, lhs, rhs, dimension_numbers, precision,
                                    preferred_element_type)


def _swapped_dot_general(site, side, weight, lhs, rhs, dimension_numbers, precision,
                         preferred_element_type):
    if side == "rhs":
        return site.convert("dot_general", (lhs, rhs, dimension_numbers),
                            precision, preferred_element_type, weight)
    (lc, rc), (lb, rb) = dimension_numbers
    out = site.convert("dot_general", (rhs, lhs, ((rc, lc), (rb, lb))),
                       precision, preferred_element_type, weight)
    # dot_general's result is (batch, lhs free, rhs free): put the swapped halves back.
    nb = len(lb)
    n_rhs_free = rhs.ndim - len(rc) - len(rb)
    n_lhs_free = lhs.ndim - len(lc) - len(lb)
    perm = (*range(nb), *range(nb + n_rhs_free, nb + n_rhs_free + n_lhs_free),
            *range(nb, nb + n_rhs_free))
    return jnp.transpose(out, perm)


def explicit_einsum(subscripts: str, lhs_shape, rhs_shape) -> str | None:
    """A two-operand einsum spec with its output and ellipses spelled out
    (``"...d,dh"`` on a 3-d lhs -> ``"abd,dh->abh"``), or None where
    `jax_fp8.fp8_einsum` cannot run it (repeated letters, an ellipsis that broadcasts,
    a malformed spec)."""
    spec = subscripts.replace(" ", "")
    ins, arrow, out = spec.partition("->")
    parts = ins.split(",")
    if len(parts) != 2:
        return None
    shapes = (tuple(lhs_shape), tuple(rhs_shape))
    # "..." stands for the leading axes of an operand; in both operands, for the same axes.
    covered = [shape[:len(shape) - len(p.replace("...", ""))]
               for p, shape in zip(parts, shapes) if "..." in p]
    if any(len(c) > len(s) for c, s in zip(covered, shapes)) or len(set(covered)) > 1:
        return None
    n = len(covered[0]) if covered else 0
    spare = [c for c in string.ascii_letters if c not in spec]
    fill = "".join(spare[:n])
    parts = [p.replace("...", fill) for p in parts]
    if arrow:
        out = out.replace("...", fill)
    else:  # numpy's implicit output: the ellipsis axes, then the letters seen once, sorted
        letters = "".join(parts)
        out = fill + "".join(sorted(c for c in set(letters)
                                    if letters.count(c) == 1 and c not in fill))
    for p, shape in zip(parts, shapes):
        if not all(c in string.ascii_letters for c in p) or len(set(p)) != len(p) \
                or len(p) != len(shape):
            return None
    if not all(c in string.ascii_letters for c in out) or len(set(out)) != len(out) \
            or not set(out) <= set(parts[0]) | set(parts[1]):
        return None
    return f"{parts[0]},{parts[1]}->{out}"


def _converting_einsum(subscripts, *operands, out=None, optimize="auto", precision=None,
                       preferred_element_type=None, _dot_general=None, **kwargs):
    # An einsum given its own dot_general (not jax.lax.dot_general) stays as it is.
    own = _dot_general not in (None, _converting_dot_general, ORIGINAL["dot_general"])
    if not own:
        _dot_general = ORIGINAL["dot_general"]  # no conversion inside jnp.einsum's jit

    def original():
        return ORIGINAL["einsum"](subscripts, *operands, out=out, optimize=optimize,
                                   precision=precision,
                                   preferred_element_type=preferred_element_type,
                                   _dot_general=_dot_general, **kwargs)

    site = _innermost()
    if site is None or own or not isinstance(subscripts, str) or len(operands) != 2 \
            or out is not None:
        return original()
    lhs, rhs = operands
    found = _weight_side(site, lhs, rhs)
    eqn = None if found is None else explicit_einsum(subscripts, jnp.shape(lhs),
                                                     jnp.shape(rhs))
    if eqn is None:
        return original()
    side, weight = found
    if side == "lhs":
        ins, res = eqn.split("->")
        a, b = ins.split(",")
        eqn, lhs, rhs = f"{b},{a}->{res}", rhs, lhs
    with running(None):
        return site.convert("einsum", (eqn, lhs, rhs), precision, preferred_element_type,
                            weight)
