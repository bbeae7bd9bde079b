"""The interception of GEMM calls that model converters share (framework-neutral).

While a converted model runs (`converting`), ``jax.lax.dot_general``, ``jax.numpy.einsum``
and the matrix products ``@``, ``jax.numpy.matmul`` and ``jax.numpy.dot`` (and the ``.dot``
method) are replaced by functions that hand a GEMM of a matched module (the innermost
`Site` `running`) to the FP8 GEMM the site's converter creates for it (a matrix product
as the ``dot_general`` with its result); every other call goes on to the function that was
installed there when the conversion began (`through`). A framework adapter
(``jax_fp8.flax``, ``jax_fp8.equinox``) says which module is running and which of its
arrays are weights; this module knows no framework.

`converting` is the one driver every adapter runs a converted call in: the report, the
replacements installed (all or none) and taken out again, the running site, and the
part of ``jax.jit``'s cache key that keeps a trace made inside a converted module from
being reused outside it (and the other way round). Its effects last for the call and act
in the calling thread only: other threads, and the same thread outside the call, see JAX
as it is.

A weight is recognised by where it came from (`follow`): the parameter itself, or an
array made from it by the operations that carry a weight's values to a GEMM unchanged but
for their dtype, layout or placement (`FOLLOWED`: a cast between floating dtypes, a
reshape, a transpose, a squeeze or a size-preserving broadcast, a copy, a sharding
constraint), as the large linen codebases write a projection
(``jnp.asarray(kernel, dtype)``, ``jnp.reshape``, ``with_sharding_constraint`` between
``self.param`` and ``lax.dot_general``). While a converting call runs, those primitives'
``bind`` record which of their results come from a tracked parameter (`track`).

What a matched module leaves out of FP8 (a GEMM below the rule's ``min_fp8_flops``, no
operand it can follow to a parameter, operands of a dtype the recipe does not take) is
reported once as a `jax_fp8.Fp8ConversionWarning` (`reporting`), and the GEMM runs under
a name scope that ``jax_fp8.devtools.explain`` reads (`KEPT_SCOPES`).

Following a weight is `jax_fp8.interception._follow`, the report
`jax_fp8.interception._report`, installing and the cache key
`jax_fp8.interception._install`, the running sites and calls
`jax_fp8.interception._running`, what a GEMM becomes and why
`jax_fp8.interception._decide`; this module re-exports their public names.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8 import _compat
from jax_fp8.interception._decide import (
    KEPT_SCOPES,
    _kept as _kept,
    _weight_side,
    check_body,
    einsum_dimension_numbers as einsum_dimension_numbers,
    einsum_flops,
    note_gemm,
)
from jax_fp8.interception._follow import (
    _BINDS,
    _TRANSFORMS,
    FOLLOWED,
    follow,
    local,
    track,
)
from jax_fp8.interception._install import conversion_key, installed, installed_now, through
from jax_fp8.interception._report import note, reporting
from jax_fp8.interception._running import (
    _SITE_KEY,
    Conversion,
    _conversions,
    _innermost as _innermost,
    current,
    running,
    weight_of,
)
from jax_fp8.interception._site import Site

__all__ = ["FOLLOWED", "KEPT_SCOPES", "ORIGINAL", "Conversion", "Site", "conversion_key",
           "check_body", "converting", "current", "einsum_flops", "explicit_einsum", "follow",
           "installed_now", "local", "note", "note_gemm", "patched", "reporting", "running",
           "through", "track", "weight_of"]

_CONTRACTIONS = _compat.numpy_contractions()
# The functions found at import (a layer given its own dot_general / einsum_op is told from
# one given JAX's by these); a call the conversion leaves alone goes to `through`'s.
ORIGINAL = {"dot_general": jax.lax.dot_general, "einsum": jnp.einsum,
            "matmul": _CONTRACTIONS.matmul, "dot": _CONTRACTIONS.dot}
# Further (owner, attribute, replacement) that `patched` installs with the two above (each
# a GEMM function a module of its own intercepts: jax_fp8.interception.ragged's
# jax.lax.ragged_dot).
PATCHES: list[tuple[Any, str, Any]] = []



@contextlib.contextmanager
def converting(owner: Any, label: str, site: Any = None, *, key: Any = _SITE_KEY,
               tag: Any = None,
               extra: Sequence[tuple[Any, str, Any]] = ()) -> Iterator[Conversion]:
    """Runs one converted call: the driver every framework adapter uses.

    In order: the report of the call (`reporting`, naming ``owner`` and ``label``; a call
    nested in another converting call reports in the outer one's), the converting
    functions installed (`patched`, with the adapter's ``extra``; all or none), the
    `Conversion` (``tag``) as this thread's innermost, and ``site`` running (`running`,
    with ``key``) with its weights tracked (`track`). All of it is undone when the call
    ends, however it ends: nothing stays installed, and no trace made inside is reused
    outside."""
    outer = current()
    conversion = Conversion(owner, label, tag, {} if outer is None else outer.data)
    stack = _conversions()
    with reporting(owner, label), patched(extra):
        stack.append(conversion)
        try:
            with running(site, key):
                if isinstance(site, Site):
                    track(*(w for _, w in site.weights))
                yield conversion
        finally:
            stack.pop()


@contextlib.contextmanager
def patched(extra: Sequence[tuple[Any, str, Any]] = ()) -> Iterator[None]:
    """Installs the converting ``jax.lax.dot_general`` / ``jax.numpy.einsum`` / matrix
    products, the following ``bind``s and `PATCHES` for the duration, and each
    ``(owner, attribute, replacement)`` of ``extra`` (a framework's own hook, e.g. the
    Flax adapter's recording ``Module.param``): all or none, reference counted per
    attribute over threads (`jax_fp8.interception._install.installed`). Other threads
    see JAX as it is, since the replacements act only where a converted method runs
    (`running`)."""
    with installed([(jax.lax, "dot_general", _converting_dot_general),
                    (jnp, "einsum", _converting_einsum), *_PRODUCTS, *_BINDS, *_TRANSFORMS,
                    *PATCHES,
                    *extra]):
        yield



# ---------------------------------------------------------------------- the GEMM calls

def _converting_dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                            preferred_element_type: Any = None, **kwargs: Any) -> Any:
    def original() -> Any:
        return through(jax.lax, "dot_general")(lhs, rhs, dimension_numbers,
                                               precision=precision,
                                               preferred_element_type=preferred_element_type,
                                               **kwargs)

    site = _innermost()
    if site is None:
        return original()
    found, scope = _weight_side(site, lhs, rhs)
    if found is None:
        return original() if scope is None else _kept(site, scope, "dot_general", lhs, rhs,
                                                      original)
    note_gemm(site, "dot_general", lhs, rhs, dimension_numbers)
    with running(None):
        return _swapped_dot_general(site, *found, lhs, rhs, dimension_numbers, precision,
                                    preferred_element_type)


def _swapped_dot_general(site: Site, side: str, weight: Any, lhs: Any, rhs: Any,
                         dimension_numbers: Any, precision: Any,
                         preferred_element_type: Any) -> Any:
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


def matmul_numbers(
        a_shape: Sequence[int], b_shape: Sequence[int],
) -> tuple[jax.lax.DotDimensionNumbers, tuple[int, ...] | None] | None:
    """``(dimension_numbers, perm)``: ``jnp.matmul(a, b)`` as ``lax.dot_general(a, b,
    dimension_numbers)`` transposed by ``perm`` (None: as it is); None where matmul
    broadcasts batch axes of different shapes (or an operand is a scalar)."""
    na, nb = len(a_shape), len(b_shape)
    if na == 0 or nb == 0:
        return None
    if nb <= 2:          # [..., K] @ [K(, N)]: the result's axes in dot_general's order
        return (((na - 1,), (0,)), ((), ())), None
    if na == 1:          # [K] @ [..., K, N]
        return (((0,), (nb - 2,)), ((), ())), None
    if na == 2:          # [M, K] @ [..., K, N]: dot_general gives [M, ..., N]
        return (((1,), (nb - 2,)), ((), ())), (*range(1, nb - 1), 0, nb - 1)
    if tuple(a_shape[:-2]) == tuple(b_shape[:-2]):   # the same batch axes
        batch = tuple(range(na - 2))
        return (((na - 1,), (nb - 2,)), (batch, batch)), None
    return None


def dot_numbers(a_shape: Sequence[int],
                b_shape: Sequence[int]) -> tuple[jax.lax.DotDimensionNumbers, None] | None:
    """``(dimension_numbers, None)``: ``jnp.dot(a, b)`` as ``lax.dot_general`` (a's last
    axis against b's second-to-last, or its only one); None for a scalar operand."""
    na, nb = len(a_shape), len(b_shape)
    if na == 0 or nb == 0:
        return None
    return (((na - 1,), (max(nb - 2, 0),)), ((), ())), None


def _converting_product(name: str, numbers: Callable[..., Any]) -> Callable[..., Any]:
    """The converting ``jnp.matmul`` / ``jnp.dot`` (``@``, ``.dot``): a GEMM of a matched
    module with one of its weights as an operand runs as the FP8 ``dot_general`` with the
    same result (`matmul_numbers`, `dot_numbers`); a form that has none is reported."""
    def converting(a: Any, b: Any, *, precision: Any = None,
                   preferred_element_type: Any = None, **kwargs: Any) -> Any:
        def original() -> Any:
            return through(jnp, name)(a, b, precision=precision,
                                      preferred_element_type=preferred_element_type, **kwargs)

        site = _innermost()
        if site is None:
            return original()
        found, scope = _weight_side(site, a, b)
        if found is None:
            return original() if scope is None else _kept(site, scope, name, a, b, original)
        plan = numbers(np.shape(a), np.shape(b))
        if plan is None:
            return _kept(site, "fp8_model_form", name, a, b, original)
        dimension_numbers, perm = plan
        note_gemm(site, name, a, b, dimension_numbers)
        with running(None):
            out = _swapped_dot_general(site, *found, a, b, dimension_numbers, precision,
                                       preferred_element_type)
            return out if perm is None else jax.lax.transpose(out, perm)

    converting.__name__ = converting.__qualname__ = name
    return converting


_converting_matmul = _converting_product("matmul", matmul_numbers)
_converting_dot = _converting_product("dot", dot_numbers)
# jnp.matmul / jnp.dot, and where the @ operator and the .dot method find them.
_PRODUCTS = [(jnp, "matmul", _converting_matmul), (jnp, "dot", _converting_dot),
             (_CONTRACTIONS, "matmul", _converting_matmul),
             (_CONTRACTIONS, "dot", _converting_dot)]


def explicit_einsum(subscripts: str, lhs_shape: Sequence[int],
                    rhs_shape: Sequence[int]) -> str | None:
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


def _converting_einsum(subscripts: Any, *operands: Any, out: Any = None, optimize: Any = "auto",
                       precision: Any = None, preferred_element_type: Any = None,
                       _dot_general: Any = None, **kwargs: Any) -> Any:
    # An einsum given its own dot_general (not jax.lax.dot_general) stays as it is.
    lax_dot_general = through(jax.lax, "dot_general")
    own = _dot_general not in (None, _converting_dot_general, ORIGINAL["dot_general"],
                               lax_dot_general)
    if _dot_general is _converting_dot_general:
        _dot_general = lax_dot_general  # no conversion inside jnp.einsum's jit
    if _dot_general is not None:
        kwargs["_dot_general"] = _dot_general

    def original() -> Any:
        # Without a dot_general of the caller's, jnp.einsum's own (JAX's), as it is.
        return through(jnp, "einsum")(subscripts, *operands, out=out, optimize=optimize,
                                      precision=precision,
                                      preferred_element_type=preferred_element_type,
                                      **kwargs)

    site = _innermost()
    if site is None or own or not isinstance(subscripts, str) or len(operands) != 2 \
            or out is not None:
        return original()
    lhs, rhs = operands
    found, scope = _weight_side(site, lhs, rhs)
    eqn = explicit_einsum(subscripts, jnp.shape(lhs), jnp.shape(rhs))
    if eqn is None:
        return original()
    if found is None:
        return original() if scope is None else _kept(site, scope, "einsum", lhs, rhs,
                                                      original)
    side, weight = found
    note_gemm(site, "einsum", lhs, rhs, einsum_dimension_numbers(eqn))
    if side == "lhs":
        ins, res = eqn.split("->")
        a, b = ins.split(",")
        eqn, lhs, rhs = f"{b},{a}->{res}", rhs, lhs
    with running(None):
        return site.convert("einsum", (eqn, lhs, rhs), precision, preferred_element_type,
                            weight)
