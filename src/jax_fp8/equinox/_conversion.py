"""`fp8_model` for Equinox models: ``eqx.nn.Linear`` leaves replaced by `Fp8Linear`, and the
GEMMs a module of one's own calls on its own weights given FP8 states of their own."""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jax_fp8 import interception, recipe as recipe_lib, rules as rules_lib
from jax_fp8.equinox._gemm import fp8_gemm
from jax_fp8.equinox._linear import Fp8Linear
from jax_fp8.equinox._state import Fp8State
from jax_fp8.gemm.ragged_fp8 import fp8_ragged_dot
from jax_fp8.meta import Fp8Meta
from jax_fp8.rules import Fp8ConversionWarning

__all__ = ["fp8_model"]

_FLOATS = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
FP8_FIELD = "fp8_states"   # the field a converted module of one's own holds its states in


def _key_name(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path(keys: Sequence[Any]) -> str:
    return "/".join(_key_name(k) for k in keys)


def _own_weights(module: eqx.Module) -> dict[str, jax.Array]:
    """The module's own float arrays of two or more axes (its weights), by field name."""
    return {f.name: getattr(module, f.name) for f in _fields(module)
            if isinstance(getattr(module, f.name, None), jax.Array)
            and getattr(module, f.name).ndim >= 2
            and np.dtype(getattr(module, f.name).dtype) in _FLOATS}


def _fields(module: eqx.Module) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(module) if not f.metadata.get("static", False)]


def _own_gemms(module: eqx.Module) -> bool:
    """Whether ``module``'s class (not Equinox's) defines a ``__call__`` of its own."""
    cls = getattr(type(module), "_fp8_unconverted", type(module))
    if cls.__module__.split(".")[0] == "equinox":
        return False
    return any("__call__" in vars(k) for k in cls.__mro__ if k not in (eqx.Module, object))


def _converting_call(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def converting(self: Any, *args: Any, **kwargs: Any) -> Any:
        states = getattr(self, FP8_FIELD)
        rule = self._fp8_rule  # noqa: SLF001
        current = {name: state.meta for name, state in states.items()}
        weights = tuple((name, getattr(self, name)) for name in states)

        def convert(kind: str, gemm_args: tuple[Any, ...], precision: Any,
                    preferred_element_type: Any, weight: str | None) -> jax.Array:
            if kind == "ragged_dot":
                return _ragged_dot(self, current, gemm_args, precision,
                                   preferred_element_type, weight)
            if kind == "dot_general":
                lhs, rhs, spec = gemm_args
            else:
                spec, lhs, rhs = gemm_args
            if weight is None:  # two activations (Fp8Rule.activations): a stateless recipe
                meta = Fp8Meta.create(rule.recipe)
            else:
                meta = current[weight]
            out, meta = fp8_gemm(kind, spec, lhs, rhs, meta, precision=precision,
                                 preferred_element_type=preferred_element_type,
                                 min_fp8_flops=rule.min_fp8_flops)
            if weight is not None:   # every GEMM of one weight threads its state
                current[weight] = meta
            return out

        cls = type(self)._fp8_unconverted  # noqa: SLF001
        # An Equinox module does not know its path in the model (a field would make the
        # modules of one class at different paths different pytrees): reported by class.
        site = interception.Site(rule, convert, weights=weights, path=cls.__qualname__,
                                 module_type=cls.__name__,
                                 where=f"each {cls.__name__} module")
        with interception.converting(type(self), cls.__name__, site):
            return call(self, *args, **kwargs)
    return converting


def _ragged_dot(module: Any, current: dict[str, Fp8Meta], gemm_args: tuple[Any, ...],
                precision: Any, preferred_element_type: Any,
                weight: Any) -> jax.Array:   # weight: a field name (a ragged_dot has one)
    """A ``jax.lax.ragged_dot`` of the expert weight ``weight`` (a mixture-of-experts
    layer): `jax_fp8.fp8_ragged_dot` with the weight's meta, for a recipe without state. A
    delayed-scaling state would be one per expert, which the states made at conversion
    (one per weight, before any call) are not."""
    rule = module._fp8_rule  # noqa: SLF001
    meta = current[weight]
    if not meta.stateless:
        offered = ", ".join(f"{n}()" for n in recipe_lib.without_state(rule.recipe))
        raise ValueError(
            f"jax_fp8.equinox.fp8_model: {type(module).__name__} multiplies its weight "
            f"{weight!r} in a jax.lax.ragged_dot (a mixture-of-experts layer), whose "
            f"delayed-scaling state is one per expert; the Equinox converter makes one state "
            f"per weight. Convert this module with a recipe without state ({offered}), or "
            f"exclude it with Fp8Rule(path=..., recipe=None) before the other rules")
    lhs, rhs, group_sizes = gemm_args
    out, _ = fp8_ragged_dot(lhs, rhs, group_sizes, meta, precision=precision,
                            preferred_element_type=preferred_element_type,
                            min_fp8_flops=rule.min_fp8_flops)
    return out


@functools.cache
def _converting_class(cls: Any, rule: Any) -> type:
    """``cls`` with a field holding the FP8 states of its weights' GEMMs, and its
    ``__call__`` run under the interception (the same signature)."""
    namespace = {"__annotations__": {FP8_FIELD: dict},
                 "__call__": _converting_call(cls.__call__),
                 "_fp8_rule": rule, "_fp8_unconverted": cls}
    new = type(cls.__name__, (cls,), namespace)
    new.__qualname__, new.__module__ = cls.__qualname__, cls.__module__
    return new


def _convert_own(module: eqx.Module, rule: rules_lib.Fp8Rule, path: str) -> Any:
    weights = _own_weights(module)
    if rule.activations and rule.recipe is not None and rule.recipe.keeps_state:
        offered = recipe_lib.spoken([f"{n}()" for n in recipe_lib.without_state(rule.recipe)])
        raise ValueError(
            f"jax_fp8.equinox.fp8_model: Fp8Rule(activations=True) with "
            f"{type(rule.recipe).__name__} (a recipe that keeps state) matches "
            f"{type(module).__name__} at {path!r}: a GEMM of two activations would need an "
            f"FP8 state of its own, which an Equinox model cannot add while it runs. Use "
            f"{offered} for that rule (they keep no state), or activations=False")
    if not weights and not rule.activations:
        return module
    module_class: Any = type(module)
    new: Any = object.__new__(_converting_class(module_class, rule))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, getattr(module, f.name))
    # A weight of a stacked module (eqx.filter_vmap) has the stack's axes in front of its
    # own; a module of one's own does not say how many, so its states are one per weight
    # (docs/equinox.md).
    object.__setattr__(new, FP8_FIELD, {name: Fp8State.create(rule.recipe) for name in weights})
    return new


def fp8_model(model: Any, rules: Any = None) -> Any:
    """``model`` (an Equinox module, or any pytree of them) with its GEMMs in FP8.

    Each ``eqx.nn.Linear`` a rule matches becomes an `Fp8Linear` (same weight, bias,
    fields and call) with the rule's recipe and ``min_fp8_flops``; a module of one's own
    (its class defines ``__call__``, Equinox's own modules excluded) that a rule matches,
    with float arrays of two or more axes as fields (its weights), gets an FP8 state per
    weight (the field ``fp8_states``, a dict by field name) and a ``__call__`` in which each
    ``jax.lax.dot_general`` / ``jnp.einsum`` of a weight runs as an FP8 GEMM, the weight
    quantized as the kernel (every GEMM of one weight in a call threads its state; a
    weight that is no GEMM's operand keeps a state that never changes: exclude such a
    module by its path). With
    ``Fp8Rule(activations=True)`` (a current or blockwise recipe) its GEMMs of two
    activations too. The model's call signature and the modules' classes (a converted
    module is an instance of a subclass of its own) are kept.

    Args:
      model: the model to convert; it is not changed (Equinox modules are immutable).
      rules: ``None`` (every ``eqx.nn.Linear`` and weight GEMM in delayed scaling), one
        `jax_fp8.Fp8Rule` or a sequence of them, matched against each module's path: its
        field names and indices joined by ``/`` (``"layers/0/attention/query_proj"``,
        ``""`` for the root); the first match decides, a rule with ``recipe=None``
        excludes.

    Returns:
      The converted model.

    Raises:
      TypeError: ``model`` is a Flax (linen or NNX) module: its converter is
        `jax_fp8.flax.fp8_model`.
      ValueError: a delayed-scaling rule with ``activations=True`` matches a module of
        one's own (a GEMM of two activations would need a state created while running).

    Warns:
      Fp8ConversionWarning: the model holds nothing to convert (no ``eqx.nn.Linear``, no
        module of one's own with a GEMM of its weights, nothing in FP8 already), so it is
        returned as it is, without FP8.
    """
    _refuse_flax(model)
    rules = rules_lib.as_rules(rules, "rules")
    seen: list[str] = []
    converted = _convert(model, (), rules, seen)
    if not seen:
        warnings.warn(
            f"jax_fp8.equinox.fp8_model: nothing to convert in the {type(model).__name__} "
            f"given (no eqx.nn.Linear, no module of one's own with a jax.lax.dot_general / "
            f"jnp.einsum of its weights): it is returned as it is, without FP8",
            Fp8ConversionWarning, stacklevel=2)
    return converted


def _refuse_flax(model: Any) -> None:
    """TypeError naming jax_fp8.flax.fp8_model for a Flax module (flax itself is only
    looked at when it was imported: a Flax module cannot exist otherwise)."""
    kinds = (("flax.linen", "Module", "linen"), ("flax.nnx", "Module", "NNX"))
    for module_name, class_name, kind in kinds:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(model, getattr(module, class_name, ())):
            raise TypeError(
                f"jax_fp8.equinox.fp8_model: model is a Flax {kind} module "
                f"({type(model).__name__}), not an Equinox one: convert it with "
                f"jax_fp8.flax.fp8_model(model, rules) (docs/convert.md)")


def _convert(node: Any, keys: tuple[Any, ...], rules: tuple[rules_lib.Fp8Rule, ...],
             seen: list[str]) -> Any:
    path = _path(keys)
    if isinstance(node, (eqx.nn.Linear, Fp8Linear)) or hasattr(type(node), "_fp8_unconverted"):
        seen.append(path)
    if isinstance(node, eqx.nn.Linear):
        rule = rules_lib.rule_for(rules, path)
        if rule is None:
            return node
        return Fp8Linear.from_linear(node, rule.recipe, rule.min_fp8_flops)
    if isinstance(node, Fp8Linear) or hasattr(type(node), "_fp8_unconverted"):
        return node   # already FP8
    is_sub = lambda x: x is not node and isinstance(x, eqx.Module)  # noqa: E731
    converted = jax.tree_util.tree_map_with_path(
        lambda p, x: _convert(x, keys + tuple(p), rules, seen)
        if isinstance(x, eqx.Module) else x,
        node, is_leaf=is_sub)
    if isinstance(converted, eqx.Module) and _own_gemms(converted):
        seen.append(path)
        rule = rules_lib.rule_for(rules, path)
        if rule is not None:
            return _convert_own(converted, rule, path)
    return converted
