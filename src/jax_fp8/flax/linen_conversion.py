"""`fp8_model` for linen models: a copy whose GEMMs go, through Flax's method interception,
to FP8 modules created in the calling module's scope.

The converted model's GEMMs run as if its layers had been written with
`jax_fp8.flax.Fp8DotGeneral` / `jax_fp8.flax.Fp8Einsum`: the same FP8 modules are created
at the same places (``nn.Dense_0/Fp8DotGeneral_0``), so the FP8 states live in the
``"fp8_meta"`` collection, the parameters keep their paths, and the numbers are those of
the hand-written model, bit for bit. While a method of the converted model runs,
``nn.intercept_methods`` tracks which module is running; Flax's ``nn.Dense``,
``nn.DenseGeneral`` and ``nn.Einsum`` (and so ``nn.MultiHeadDotProductAttention``'s
projections) call the intercepted GEMM functions, as do most hand-written modules.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import flax.linen as nn
from flax import errors as flax_errors

from jax_fp8 import interception
from jax_fp8.flax.rules import PARAM_PATCH, Fp8Rule, Site, recorded_params, rule_for, running

__all__ = ["convert"]


# Flax layers whose GEMM has the layer's kernel as its rhs.
_LINEN_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum)
# Flax layers that take a GEMM of the user's (then left as it is).
_LINEN_OWN_GEMM = (nn.Dense, nn.DenseGeneral)


def _linen_path(module: nn.Module) -> str | None:
    if getattr(module, "scope", None) is None:
        return None
    return "/".join(str(p) for p in module.path)


def _linen_weights(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """(name, array) of the module's parameters: the arrays its ``self.param`` calls
    returned in this converted call, then those of its params collection (unboxed)."""
    weights: list[tuple[str, Any]] = []
    recorded = (recorded_params() or {}).get(id(module))
    if recorded is not None and recorded[0] is module:
        weights.extend(recorded[1].items())
    try:
        params = module.variables.get("params", {})
    except Exception:  # noqa: BLE001  (an unbound or uninitialised module: no params)
        params = {}
    weights.extend((name, nn.meta.unbox(v)) for name, v in params.items()
                   if not isinstance(v, Mapping))
    return tuple((name, v) for name, v in weights if hasattr(v, "dtype"))


def _keeps_own_gemm(module: object) -> bool:
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


def _no_submodule_here(module: nn.Module, kind: str) -> TypeError:
    path = _linen_path(module)
    return TypeError(
        f"fp8_model: module {path!r} ({type(module).__name__}) calls a {kind} with a "
        f"parameter operand from a method that is neither setup nor @nn.compact, where "
        f"Flax allows no submodule to hold its FP8 state. Exclude it with "
        f"Fp8Rule(path={path!r}, recipe=None) before the other rules, or make the method "
        f"@nn.compact")


def _weight_layer(module: Any, rule: Fp8Rule, weight: str, kind: str) -> nn.Module:
    """The module's `_WeightFp8` ``<weight>_fp8``: the one created earlier in this call
    of the module (so every GEMM of the weight threads one state), else a new one."""
    # ``module``: a bound linen module (Any: Flax types its ``scope`` as optional).
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
        # Fp8Rule.__post_init__ made min_fp8_flops a number or "measured".
        return fp8_linen._WeightFp8(recipe=rule.recipe,  # noqa: SLF001
                                    min_fp8_flops=rule.min_fp8_flops,
                                    name=name)
    except flax_errors.AssignSubModuleError:
        raise _no_submodule_here(module, kind) from None


def _linen_convert(module: nn.Module, rule: Fp8Rule, kind: str, args: tuple[Any, ...],
                   precision: Any, preferred_element_type: Any,
                   weight: str | None = None) -> Any:
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


def _linen_rule(rules: tuple[Fp8Rule, ...], module: nn.Module) -> Fp8Rule | None:
    """The rule that converts a running linen module's GEMMs, or None (none matches, an
    exclusion, a layer with a GEMM of its own, jax_fp8's own FP8 modules, an ``nn.Embed``
    whose attend stays as it is)."""
    from jax_fp8.flax import linen as fp8_linen
    if isinstance(module, (fp8_linen.Fp8DotGeneral, fp8_linen.Fp8Einsum,
                           fp8_linen._WeightFp8, nn.Embed)):  # noqa: SLF001
        return None
    path = _linen_path(module)
    rule = None if path is None else rule_for(rules, path)
    if rule is None or _keeps_own_gemm(module):
        return None
    return rule


def _linen_site(rule: Fp8Rule, module: nn.Module) -> Site:
    """The conversion of a running linen module's GEMMs (made at each GEMM: the module's
    params exist only once its method has created them)."""
    path = _linen_path(module)
    # Reported from an apply, not while init creates the variables (often at a batch
    # size of its own).
    return Site(rule, functools.partial(_linen_convert, module, rule),
                weights=_linen_weights(module),
                rhs_is_weight=isinstance(module, _LINEN_LAYERS),
                path=None if module.is_initializing() else path,
                module_type=type(module).__name__, rule_path=path)


def _site_and_key(rules: tuple[Fp8Rule, ...], module: nn.Module
                  ) -> tuple[Callable[[], Site], tuple[Fp8Rule, bool]] | tuple[None, None]:
    """``(site, key)`` of a running linen module method for `interception.running`: its
    site, made at each GEMM, and the key of its rule; ``(None, None)``: its GEMMs stay as
    they are."""
    rule = _linen_rule(rules, module)
    if rule is None:
        return None, None
    return (functools.partial(_linen_site, rule, module),
            (rule, isinstance(module, _LINEN_LAYERS)))


def _linen_interceptor(conversion: interception.Conversion, rules: tuple[Fp8Rule, ...]
                       ) -> Callable[..., Any]:
    """Flax's method interceptor for one converting call: tracks the running module while
    that call is the innermost (a converting call nested in it, of a model with rules of
    its own, tracks its modules itself)."""
    def interceptor(next_fun: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any], context: Any) -> Any:
        if interception.current() is not conversion:
            return next_fun(*args, **kwargs)
        site, key = _site_and_key(rules, context.module)
        with running(site, key=key):
            return next_fun(*args, **kwargs)
    return interceptor


def _raw_method(cls: type, name: str) -> Callable[..., Any]:
    method = getattr(cls, name)
    while hasattr(method, "method_handler_wrapped"):
        method = method.__wrapped__
    return cast(Callable[..., Any], method)


@functools.cache
def _converted_class(cls: type, rules: tuple[Fp8Rule, ...], methods: tuple[str, ...]) -> type:
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


def _converting_method(method: Callable[..., Any], rules: tuple[Fp8Rule, ...]
                       ) -> Callable[..., Any]:
    tag = ("linen", rules)

    @functools.wraps(method)
    def converting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        outer = interception.current()
        if outer is not None and outer.tag == tag:
            # A method of a model converted with the same rules, called from a converting
            # call (the model's own methods, or a model nested in it): that call converts it.
            return method(self, *args, **kwargs)
        site, key = _site_and_key(rules, self)
        with interception.converting(type(self), type(self).__name__, site, key=key,
                                     tag=tag, extra=(PARAM_PATCH,)) as conversion, \
                nn.intercept_methods(_linen_interceptor(conversion, rules)):
            return method(self, *args, **kwargs)
    return converting


def convert(model: nn.Module, rules: tuple[Fp8Rule, ...], methods: Sequence[str]) -> nn.Module:
    """`jax_fp8.flax.fp8_model` for a linen ``model``: its converted copy."""
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
        raise TypeError(f"fp8_model(methods=...): a sequence of method names, got "
                        f"{methods!r}")
    cls: type = getattr(type(model), "_fp8_unconverted", type(model))
    new_cls = _converted_class(cls, rules, tuple(methods))
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.init and f.name not in ("parent", "name")}
    return cast(nn.Module, new_cls(**fields, name=model.name, parent=model.parent))
