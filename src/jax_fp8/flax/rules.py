"""`Fp8Rule` (which GEMMs `fp8_model` makes FP8) and the GEMM-call interception both
converters (linen, NNX) share.

While a converted model runs, ``jax.lax.dot_general`` and ``jax.numpy.einsum`` are
replaced by functions that hand a GEMM of a matched module (the innermost `Site`
`running`) to an FP8 module created for it; everything else goes to the original
functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import string
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8 import recipe as recipe_lib
from jax_fp8.dot_general import check_min_fp8_flops
from jax_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

__all__ = ["AUTO_MIN_FP8_FLOPS", "Fp8Rule", "Site", "as_rules", "patched", "rule_for",
           "running"]



# Per recipe, the forward FLOPs below which a converted GEMM stays in the operands' dtype
# (Fp8Rule's min_fp8_flops="auto"): above each recipe's measured break-even, where one
# layer's FP8 casts, amaxes and transposes cost as much as its faster GEMMs save
# (docs/benchmarks.md, "One Dense layer: where FP8 starts to pay").
AUTO_MIN_FP8_FLOPS = {DelayedScaling: 2.0 ** 36, Float8CurrentScaling: 2.0 ** 37,
                      Float8BlockScaling: 2.0 ** 37}


@dataclasses.dataclass(frozen=True)
class Fp8Rule:
    """Which GEMMs of a model `fp8_model` makes FP8, and with which recipe.

    Rules are tried in order for the module that calls a GEMM; the first whose ``path``
    matches decides; a GEMM of a module no rule matches stays as it is.

    Attributes:
      path: a regular expression matched in full (``re.fullmatch``) against the module's
        path: its names joined by ``/``, e.g. ``"encoder/layers_0/attention/query"``
        (``""`` for the root module). The default ``".*"`` matches every module.
      recipe: ``DelayedScaling()`` (the default), ``Float8CurrentScaling()`` or
        ``Float8BlockScaling()``: the recipe of the FP8 layers the rule creates. None
        keeps the matched GEMMs as they are (an exclusion, e.g. for an LM head).
      min_fp8_flops: GEMMs with fewer FLOPs (``2 * batch * M * N * K`` of the forward
        product, known at trace time) run in the operands' dtype (the FP8 layers'
        attribute of that name); 0: all in FP8. ``"auto"`` (the default): the recipe's
        `AUTO_MIN_FP8_FLOPS`, below which FP8 does not pay (the casts, amaxes and
        transposes cost more than the faster GEMMs save), so that converting a model
        does not make it slower. ``jax_fp8.devtools.explain`` lists which GEMMs
        of a converted model run in FP8 and which were kept.
      activations: False (the default): only GEMMs with a parameter operand become FP8
        (a layer's kernel; in a hand-written module, an array the module read from its
        own ``params``). True: every GEMM of the matched modules, the attention scores
        (``q @ k``) and the attention-weighted values (``p @ v``) included.

    Raises:
      TypeError / ValueError: a bad path, recipe, min_fp8_flops or activations.
    """

    path: str = ".*"
    recipe: Any = DelayedScaling()
    min_fp8_flops: float | str = "auto"
    activations: bool = False

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise TypeError(f"Fp8Rule.path must be a regular expression (str), got "
                            f"{self.path!r}")
        try:
            re.compile(self.path)
        except re.error as err:
            raise ValueError(f"Fp8Rule.path {self.path!r} is not a regular expression: "
                             f"{err}") from None
        if self.recipe is not None:
            recipe_lib.check_recipe(self.recipe, "Fp8Rule.recipe")
        flops = self.min_fp8_flops
        if isinstance(flops, str):
            if flops != "auto":
                raise ValueError(f"Fp8Rule.min_fp8_flops must be a number of FLOPs or "
                                 f"'auto', got {flops!r}")
            flops = 0 if self.recipe is None else AUTO_MIN_FP8_FLOPS[type(self.recipe)]
        object.__setattr__(self, "min_fp8_flops",
                           check_min_fp8_flops(flops, "Fp8Rule.min_fp8_flops"))
        if not isinstance(self.activations, bool):
            raise TypeError(f"Fp8Rule.activations must be True or False, got "
                            f"{self.activations!r}")

    def matches(self, path: str) -> bool:
        """Whether the rule applies to the module at ``path`` (names joined by ``/``)."""
        return re.fullmatch(self.path, path) is not None


def as_rules(rules, name: str = "rules") -> tuple[Fp8Rule, ...]:
    """``rules`` (None, one `Fp8Rule` or a sequence of them) as a tuple; None: every GEMM
    with a parameter operand in delayed scaling (``(Fp8Rule(),)``)."""
    if rules is None:
        return (Fp8Rule(),)
    if isinstance(rules, Fp8Rule):
        return (rules,)
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        raise TypeError(f"{name} must be an Fp8Rule or a sequence of them, got {rules!r}")
    for i, rule in enumerate(rules):
        if not isinstance(rule, Fp8Rule):
            raise TypeError(f"{name}[{i}] must be a jax_fp8.flax.Fp8Rule, got {rule!r}")
    return tuple(rules)


def rule_for(rules: tuple[Fp8Rule, ...], path: str) -> Fp8Rule | None:
    """The first rule matching ``path``, or None (also when that rule's recipe is None)."""
    for rule in rules:
        if rule.matches(path):
            return rule if rule.recipe is not None else None
    return None


# ------------------------------------------------------------------ the GEMM calls

ORIGINAL = {"dot_general": jax.lax.dot_general, "einsum": jnp.einsum,
            "param": nn.Module.param}
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


# This thread's converting call: its Sites (`running`), and for linen the parameters its
# modules' ``self.param`` returned (`_recording_param`).
local = threading.local()
_lock = threading.Lock()
_installed = [0]


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


def _recording_param(module, name, *args, **kwargs):
    """``nn.Module.param`` that also records, for the converted call running in this
    thread, the very array it returns (after any unboxing: a partitioned parameter under
    a mesh comes back as a new, sharding-constrained array), so a GEMM of it is known
    as a GEMM of the parameter ``name``."""
    value = ORIGINAL["param"](module, name, *args, **kwargs)
    params = getattr(local, "params", None)
    if params is not None and hasattr(value, "dtype"):
        params.setdefault(id(module), (module, {}))[1][name] = value
    return value


@contextlib.contextmanager
def patched():
    """Installs the converting ``jax.lax.dot_general`` / ``jax.numpy.einsum`` (and the
    recording linen ``Module.param``) for the duration (reference counted over threads;
    other threads see the original behaviour: the replacements act only where a
    converted method runs)."""
    with _lock:
        if _installed[0] == 0:
            jax.lax.dot_general = _converting_dot_general
            jnp.einsum = _converting_einsum
            nn.Module.param = _recording_param
        _installed[0] += 1
    try:
        yield
    finally:
        with _lock:
            _installed[0] -= 1
            if _installed[0] == 0:
                jax.lax.dot_general = ORIGINAL["dot_general"]
                jnp.einsum = ORIGINAL["einsum"]
                nn.Module.param = ORIGINAL["param"]


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
