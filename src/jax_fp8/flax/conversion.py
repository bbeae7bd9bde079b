"""FP8 for a Flax model you did not write: `Fp8Rule` and the linen `fp8_model` converter.

`fp8_model(model, rules)` returns a copy of a linen model whose GEMMs run as if its
layers had been written with `jax_fp8.flax.Fp8DotGeneral` / `jax_fp8.flax.Fp8Einsum`:
the same FP8 modules are created at the same places (``nn.Dense_0/Fp8DotGeneral_0``),
so the FP8 states live in the ``"fp8_meta"`` collection, the parameters keep their
paths, and the numbers are those of the hand-written model, bit for bit.

How: while a method of the converted model runs, Flax's method interception
(``nn.intercept_methods``) tracks which module is running, and ``jax.lax.dot_general``
and ``jax.numpy.einsum`` are replaced by functions that hand a GEMM of a matched module
to an FP8 module created in that module's scope. Flax's ``nn.Dense``,
``nn.DenseGeneral`` and ``nn.Einsum`` (and so ``nn.MultiHeadDotProductAttention``'s
projections) call exactly these functions, as do most hand-written modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import string
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors

from jax_fp8 import recipe as recipe_lib
from jax_fp8.dot_general import check_min_fp8_flops
from jax_fp8.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

__all__ = ["AUTO_MIN_FP8_FLOPS", "Fp8Rule", "fp8_model"]


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


_local = threading.local()
_lock = threading.Lock()
_installed = [0]


def _frames() -> list:
    if not hasattr(_local, "frames"):
        _local.frames = []
    return _local.frames


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


# ------------------------------------------------------------------------- linen

# Flax layers whose GEMM has the layer's kernel as its rhs.
_LINEN_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum)
# Flax layers that take a GEMM of the user's (then left as it is).
_LINEN_OWN_GEMM = (nn.Dense, nn.DenseGeneral)


def _recording_param(module, name, *args, **kwargs):
    """``nn.Module.param`` that also records, for the converted call running in this
    thread, the very array it returns (after any unboxing: a partitioned parameter under
    a mesh comes back as a new, sharding-constrained array), so a GEMM of it is known
    as a GEMM of the parameter ``name``."""
    value = ORIGINAL["param"](module, name, *args, **kwargs)
    params = getattr(_local, "params", None)
    if params is not None and hasattr(value, "dtype"):
        params.setdefault(id(module), (module, {}))[1][name] = value
    return value


def _linen_path(module) -> str | None:
    if getattr(module, "scope", None) is None:
        return None
    return "/".join(str(p) for p in module.path)


def _linen_weights(module) -> tuple:
    """(name, array) of the module's parameters: the arrays its ``self.param`` calls
    returned in this converted call, then those of its params collection (unboxed)."""
    weights = []
    recorded = (getattr(_local, "params", None) or {}).get(id(module))
    if recorded is not None and recorded[0] is module:
        weights.extend(recorded[1].items())
    try:
        params = module.variables.get("params", {})
    except Exception:  # noqa: BLE001  (an unbound or uninitialised module: no params)
        params = {}
    weights.extend((name, nn.meta.unbox(v)) for name, v in params.items()
                   if not isinstance(v, Mapping))
    return tuple((name, v) for name, v in weights if hasattr(v, "dtype"))


def _keeps_own_gemm(module) -> bool:
    """Whether ``module`` is, or runs inside, a layer given its own ``dot_general`` /
    ``dot_general_cls`` (a GEMM of the user's choice: left as it is)."""
    from jax_fp8.flax import linen as fp8_linen
    while isinstance(module, nn.Module):
        if isinstance(module, _LINEN_OWN_GEMM):
            cls = getattr(module, "dot_general_cls", None)
            own = getattr(module, "dot_general", None) is not None or cls is not None
            # A layer written with jax_fp8's FP8 dot_general is FP8 already.
            if own and not (isinstance(cls, type) and issubclass(cls, fp8_linen.Fp8DotGeneral)):
                return True
        module = module.parent
    return False


def _no_submodule_here(module, kind):
    path = _linen_path(module)
    return TypeError(
        f"fp8_model: module {path!r} ({type(module).__name__}) calls a {kind} with a "
        f"parameter operand from a method that is neither setup nor @nn.compact, where "
        f"Flax allows no submodule to hold its FP8 state. Exclude it with "
        f"Fp8Rule(path={path!r}, recipe=None) before the other rules, or make the method "
        f"@nn.compact")


def _weight_layer(module, rule: Fp8Rule, weight: str, kind: str):
    """The module's `_WeightFp8` ``<weight>_fp8``: the one created earlier in this call
    of the module (so every GEMM of the weight threads one state), else a new one."""
    from jax_fp8.flax import linen as fp8_linen
    name = f"{weight}_fp8"
    if module.scope.name_reserved(name):
        layer = module._state.children.get(name)  # noqa: SLF001  (made in this call)
        if isinstance(layer, fp8_linen._WeightFp8):  # noqa: SLF001
            return layer
        raise TypeError(
            f"fp8_model: module {_linen_path(module)!r} ({type(module).__name__}) has a "
            f"submodule or variable named {name!r}, the name of the FP8 state of its "
            f"parameter {weight!r}. Rename it, or exclude the module with "
            f"Fp8Rule(path={_linen_path(module)!r}, recipe=None) before the other rules")
    try:
        # Fp8Rule.__post_init__ made min_fp8_flops a number.
        return fp8_linen._WeightFp8(recipe=rule.recipe,  # noqa: SLF001
                                    min_fp8_flops=cast(float, rule.min_fp8_flops),
                                    name=name)
    except flax_errors.AssignSubModuleError:
        raise _no_submodule_here(module, kind) from None


def _linen_convert(module, rule: Fp8Rule, kind, args, precision, preferred_element_type,
                   weight=None):
    from jax_fp8.flax import linen as fp8_linen
    if weight is not None:   # a GEMM of the module's own parameter: that weight's state
        layer = _weight_layer(module, rule, weight, kind)
        return layer(kind, args, precision, preferred_element_type)
    # A layer's kernel (one GEMM per call), or two activations: by call order.
    # Either layer, called with its own arguments (`args`).
    cls: Any = fp8_linen.Fp8DotGeneral if kind == "dot_general" else fp8_linen.Fp8Einsum
    try:
        layer = cls(recipe=rule.recipe, min_fp8_flops=rule.min_fp8_flops)
    except flax_errors.AssignSubModuleError:
        raise _no_submodule_here(module, kind) from None
    return layer(*args, precision=precision, preferred_element_type=preferred_element_type)


def _linen_site(rules, module) -> Site | None:
    """The conversion of a running linen module's GEMMs (looked up at each GEMM: the
    module's params exist only once its method has created them)."""
    from jax_fp8.flax import linen as fp8_linen
    if isinstance(module, (fp8_linen.Fp8DotGeneral, fp8_linen.Fp8Einsum,
                           fp8_linen._WeightFp8)):  # noqa: SLF001
        return None
    path = _linen_path(module)
    rule = None if path is None else rule_for(rules, path)
    if rule is None or _keeps_own_gemm(module):
        return None
    return Site(rule, functools.partial(_linen_convert, module, rule),
                weights=_linen_weights(module),
                rhs_is_weight=isinstance(module, _LINEN_LAYERS))


def _linen_interceptor(rules):
    def interceptor(next_fun, args, kwargs, context):
        with running(functools.partial(_linen_site, rules, context.module)):
            return next_fun(*args, **kwargs)
    return interceptor


def _raw_method(cls, name: str):
    method = getattr(cls, name)
    while hasattr(method, "method_handler_wrapped"):
        method = method.__wrapped__
    return method


@functools.cache
def _converted_class(cls, rules: tuple[Fp8Rule, ...], methods: tuple[str, ...]):
    fields = {"_fp8_unconverted": cls, "_fp8_rules": rules}
    for name in methods:
        if not callable(getattr(cls, name, None)):
            raise AttributeError(f"fp8_model: {cls.__name__} has no method {name!r} "
                                 f"(methods={methods!r})")
        fields[name] = _converting_method(_raw_method(cls, name), rules)
    # The same name, so an enclosing module auto-names it as before (Dense_0, Block_1).
    new = type(cls.__name__, (cls,), fields)
    new.__qualname__ = cls.__qualname__
    new.__module__ = cls.__module__
    return new


def _converting_method(method, rules):
    interceptor = _linen_interceptor(rules)

    @functools.wraps(method)
    def converting(self, *args, **kwargs):
        if getattr(_local, "converting", 0):
            return method(self, *args, **kwargs)
        _local.converting, _local.params = 1, {}
        try:
            with patched(), nn.intercept_methods(interceptor), \
                    running(functools.partial(_linen_site, rules, self)):
                return method(self, *args, **kwargs)
        finally:
            # The recorded parameters live for this call only.
            _local.converting, _local.params = 0, None
    return converting


def fp8_model(model: Any, rules: Fp8Rule | Sequence[Fp8Rule] | None = None, *example_args: Any,
              methods: Sequence[str] = ("__call__",), **example_kwargs: Any) -> Any:
    """The ``model`` (linen or NNX) with its GEMMs in FP8, the model's code unchanged.

    **Linen** (``model`` a ``flax.linen.Module``; returns a converted copy): every
    ``jax.lax.dot_general`` / ``jax.numpy.einsum`` call made while one of the model's
    ``methods`` runs (the model's own and its submodules', under ``nn.scan``,
    ``nn.remat``, ``nn.vmap`` and the like) is handed, when a rule matches the calling
    module and one operand is a parameter, to a `jax_fp8.flax.Fp8DotGeneral` /
    `jax_fp8.flax.Fp8Einsum` created in that module: exactly the module, the variables
    and the numbers of the model written with those layers (``nn.Dense(...,
    dot_general_cls=Fp8DotGeneral)``). This covers ``nn.Dense``, ``nn.DenseGeneral``,
    ``nn.Einsum`` (their kernel is the rhs), ``nn.MultiHeadDotProductAttention``'s
    projections (``DenseGeneral``s) and hand-written modules' ``dot_general`` / ``einsum``
    of an activation and a parameter (the array the module's ``self.param`` returned, a
    partitioned parameter's under a mesh included; the parameter quantized as the
    kernel, whichever side it is on). Such a GEMM of the parameter ``w`` gets the state
    of ``w``, the module ``<module>/w_fp8`` (the variables of an ``Fp8Einsum`` /
    ``Fp8DotGeneral`` of that name), whatever GEMMs ran before it; every GEMM of ``w`` in
    a call threads that one state (amaxes by max). The attention scores and weighted
    values (two activations) stay as they are unless a rule says ``activations=True``
    (then ``Fp8Einsum_<i>`` / ``Fp8DotGeneral_<i>``, by call order in the module). A GEMM
    that stays in high precision: ``jnp.matmul`` / ``@`` / ``jnp.dot``, an einsum of
    other than two operands or with a broadcasting ellipsis, a layer given its own
    ``dot_general`` or ``dot_general_cls`` (``nn.Dense``, ``nn.DenseGeneral``) and every
    GEMM inside it, an einsum given its own ``_dot_general``.

    **NNX** (``model`` an ``flax.nnx.Module``; converted in place): every ``nnx.Linear``,
    ``nnx.LinearGeneral`` and ``nnx.Einsum`` whose path (attribute names joined by ``/``,
    e.g. ``"blocks/0/mlp/up"``) a rule matches gets the FP8 GEMM of that rule:
    ``dot_general=jax_fp8.flax.nnx.Fp8DotGeneral(recipe, min_fp8_flops=...)`` (an
    ``einsum_op`` for ``nnx.Einsum``), exactly the layer, the ``Fp8State`` variables and
    the numbers of the model written with ``Fp8Linear``. Layers stacked by ``nnx.vmap``
    (for ``nnx.scan`` over layers) get stacked FP8 states, one per layer. A matched
    module's own ``jnp.einsum`` / ``jax.lax.dot_general`` of one of its ``nnx.Param``s
    (``self.w[...]``) goes through ``w_fp8``, an FP8 module added to it at the first call
    that multiplies ``w``; that call must run outside ``jit`` / ``grad`` / ``scan``: pass
    example inputs, which ``fp8_model`` feeds to the model once. Such calls of a module
    stacked by ``nnx.vmap`` cannot get states: exclude it. Activation GEMMs, and the
    layers and GEMMs that stay as they are, as for linen.

    In both, the first matching rule decides, a rule with ``recipe=None`` keeps its
    layers as they are, and by default (``Fp8Rule.min_fp8_flops="auto"``) a GEMM too
    small for FP8 to pay runs in its dtype (``jax_fp8.devtools.explain`` lists them).

    Args:
      model: a linen module (unbound), e.g. ``nn.MultiHeadDotProductAttention(4)`` or a
        model class from another package; or an NNX module.
      rules: an `Fp8Rule`, a sequence of them (the first matching rule decides), or None
        (``Fp8Rule()``: every GEMM with a parameter operand, delayed scaling).
      *example_args, **example_kwargs: NNX only: inputs of ``model(...)``, called once
        (eagerly) to add the FP8 modules of the modules' own GEMMs; none: they are added
        at the first eager call.
      methods: linen only: the methods through which the model is applied
        (``model.apply(..., method=...)``); GEMMs run outside them stay as they are.

    Returns:
      Linen: a module of a subclass of ``type(model)`` with the same name and fields. Its
      ``init`` adds the FP8 collection (``"fp8_meta"``, delayed scaling) to the
      variables; ``params`` are those of ``model`` (same paths, shapes and initial
      values), so a checkpoint of ``model``'s params loads into it. Train with
      `Fp8TrainState` as a hand-written FP8 model. NNX: ``model`` itself, its
      ``nnx.Param``s unchanged; train it with ``jax_fp8.flax.nnx.fp8_value_and_grad`` and
      ``Fp8Optimizer`` as a hand-written FP8 model.

    Raises:
      TypeError: ``model`` is neither a linen nor an NNX module, an argument of the other
        kind of model (example inputs for linen, ``methods`` for NNX), or a bad rule; at
        trace time (linen), a GEMM with a parameter operand in a method where Flax allows
        no submodule, or a module holding a submodule named ``<parameter>_fp8`` of its own.
      ValueError: at trace time (NNX), a module's own GEMM with a parameter operand, not
        seen by an eager call, runs inside a transformation.
    """
    from flax import nnx  # NNX is optional for linen users; its converter imports it too

    if isinstance(model, nnx.Module):
        if tuple(methods) != ("__call__",):
            raise TypeError("fp8_model(methods=...) is for linen models; an NNX model is "
                            "converted in place, every method")
        from jax_fp8.flax import nnx_conversion

        return nnx_conversion.convert(model, as_rules(rules), *example_args, **example_kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8_model(model): model must be a flax.linen or flax.nnx Module, "
                        f"got {type(model).__name__}")
    if example_args or example_kwargs:
        raise TypeError("fp8_model: example inputs are for NNX models (a linen model gets "
                        "its FP8 modules at init)")
    rules = as_rules(rules)
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
        raise TypeError(f"fp8_model(methods=...): a sequence of method names, got "
                        f"{methods!r}")
    cls: type = getattr(type(model), "_fp8_unconverted", type(model))
    new_cls = _converted_class(cls, rules, tuple(methods))
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.init and f.name not in ("parent", "name")}
    return new_cls(**fields, name=model.name, parent=model.parent)
