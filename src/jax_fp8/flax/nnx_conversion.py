"""`fp8_model` for NNX models: each ``nnx.Linear`` / ``LinearGeneral`` / ``Einsum`` given jax_fp8's
FP8 GEMM in place, and a module's own GEMMs of its parameters through FP8 modules it is given (the
rules: flax/rules.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp8 import interception
from jax_fp8.flax import rules as rules_lib
from jax_fp8.flax._nnx_layers import Fp8DotGeneral, Fp8Einsum, Fp8RaggedDot, _Fp8Base, _get
from jax_fp8.gemm.dot_general import fp8_dot_general
from jax_fp8.gemm.einsum import fp8_einsum

__all__ = ["convert"]


def _stacked(layer: Any, lead: tuple[int, ...]) -> Any:
    """``layer`` with its FP8 states broadcast to the leading axes ``lead`` of a stacked
    (``nnx.vmap``-created) layer's kernel: the states ``nnx.vmap`` would have made."""
    if lead:
        for name in ("input", "kernel", "grad"):
            var = getattr(layer, name, None)
            if var is not None:
                var.set_value(jax.tree.map(
                    lambda x: jnp.array(jnp.broadcast_to(x, lead + x.shape)), _get(var)))
    return layer


def _convert(module: nnx.Linear | nnx.LinearGeneral | nnx.Einsum, rule: rules_lib.Fp8Rule,
             path: str) -> bool:
    """Gives one ``nnx.Linear`` / ``LinearGeneral`` / ``Einsum`` an FP8 GEMM of ``rule``;
    False where the module keeps its own (a custom ``dot_general`` / ``einsum_op``)."""
    kernel = _get(module.kernel)
    layer: type[Fp8DotGeneral | Fp8Einsum]
    if isinstance(module, nnx.Linear):
        if module.dot_general is not rules_lib.ORIGINAL["dot_general"]:
            return False
        layer, lead, attr = Fp8DotGeneral, kernel.shape[:-2], "dot_general"
    elif isinstance(module, nnx.LinearGeneral):
        if module.dot_general is not None or module.dot_general_cls is not None:
            return False
        n = len(module.batch_axis) + len(module.in_features) + len(module.out_features)
        layer, lead, attr = Fp8DotGeneral, kernel.shape[:kernel.ndim - n], "dot_general"
    elif isinstance(module, nnx.Einsum):
        if module.einsum_op is not rules_lib.ORIGINAL["einsum"]:
            return False
        n = len(module.kernel_shape)
        layer, lead, attr = Fp8Einsum, kernel.shape[:kernel.ndim - n], "einsum_op"
    else:
        return False
    fp8: Any = layer(rule.recipe, min_fp8_flops=rule.min_fp8_flops)
    fp8._fp8_report = (path, type(module).__name__, rule)  # noqa: SLF001  (static)
    # nnx.data: the attribute, a function before, now holds a module (as in Fp8Linear).
    setattr(module, attr, nnx.data(_stacked(fp8, tuple(lead))))
    return True


_LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


def _own_params(module: nnx.Module) -> tuple[tuple[str, Any], ...]:
    """(attribute name, array) of the module's own ``nnx.Param``s."""
    return tuple((name, _get(v)) for name, v in vars(module).items()
                 if isinstance(v, nnx.Param))


def _raw_convert(module: nnx.Module, rule: rules_lib.Fp8Rule, counts: dict[str, int],
                 kind: str, args: tuple[Any, Any, Any], precision: Any,
                 preferred_element_type: Any, weight: str | None = None) -> jax.Array:
    """A module's own GEMM through an FP8 module of ``module``, created at the first
    eager call: ``<weight>_fp8`` for a GEMM of its parameter ``<weight>`` (every GEMM of
    that weight shares and threads its state), else (two activations)
    ``Fp8DotGeneral_<i>`` / ``Fp8Einsum_<i>``, the i-th of its kind in the call."""
    cls: type[_Fp8Base] = {"dot_general": Fp8DotGeneral, "einsum": Fp8Einsum}.get(
        kind, Fp8RaggedDot)
    if weight is not None:
        name = f"{weight}_fp8"
    else:
        name = f"{cls.__name__}_{counts[kind]}"
        counts[kind] += 1
    layer = getattr(module, name, None)
    traced = any(isinstance(x, jax.core.Tracer) for x in args[:3])
    if layer is None and traced and not rule.recipe.keeps_state:
        # A recipe without state, first called inside a transformation the module cannot be
        # changed in (a jax.shard_map body the weight was passed into): nothing to keep, so
        # the FP8 layer is made for this call only.
        groups = {"num_groups": args[1].shape[0]} if cls is Fp8RaggedDot else {}
        layer = cls(rule.recipe, min_fp8_flops=rule.min_fp8_flops, **groups)
        return cast(jax.Array, layer(*args, precision=precision,
                                     preferred_element_type=preferred_element_type))
    if layer is None:
        if traced:
            raise ValueError(
                f"jax_fp8.flax.fp8_model: {type(module).__name__} calls a {kind} with a "
                f"parameter operand that the conversion has not seen yet, inside a "
                f"transformation (jit, grad, scan, ...), where no FP8 state can be added. "
                f"Convert with example inputs, fp8_model(model, rules, *inputs), which calls "
                f"the model once to create them, or exclude the module with "
                f"Fp8Rule(path=..., recipe=None) before the other rules")
        groups = {"num_groups": args[1].shape[0]} if cls is Fp8RaggedDot else {}
        layer = cls(rule.recipe, min_fp8_flops=rule.min_fp8_flops, **groups)
        setattr(module, name, nnx.data(layer))
    elif not isinstance(layer, _Fp8Base):
        raise TypeError(
            f"jax_fp8.flax.fp8_model: {type(module).__name__} has an attribute {name!r}, "
            f"the name of the FP8 state of its parameter {weight!r}. Rename it, or exclude "
            f"the module with Fp8Rule(path=..., recipe=None) before the other rules")
    if isinstance(layer, cls):
        return cast(jax.Array, layer(*args, precision=precision,
                                     preferred_element_type=preferred_element_type))
    if isinstance(layer, Fp8RaggedDot) or cls is Fp8RaggedDot:
        raise TypeError(
            f"jax_fp8.flax.fp8_model: {type(module).__name__} multiplies its parameter "
            f"{weight!r} both in a ragged_dot (one FP8 state per expert) and in another GEMM "
            f"(one state); exclude the module with Fp8Rule(path=..., recipe=None)")
    # The weight's state was made by a GEMM of the other kind: the same state, threaded.
    if kind == "dot_general":
        out, meta = fp8_dot_general(*args, layer.meta, precision, preferred_element_type,
                                    min_fp8_flops=layer.min_fp8_flops)
    else:
        out, meta = fp8_einsum(*args, layer.meta, preferred_element_type=preferred_element_type,
                               min_fp8_flops=layer.min_fp8_flops)
    layer._thread(meta)  # noqa: SLF001
    return out


def _converting_call(method: Callable[..., Any], rule: rules_lib.Fp8Rule | None
                     ) -> Callable[..., Any]:
    @functools.wraps(method)
    def converting(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        if rule is None:   # an unmatched module: its GEMMs stay as they are
            with rules_lib.running(None):
                return method(self, *args, **kwargs)
        counts = {"dot_general": 0, "einsum": 0}
        weights = _own_params(self)
        path = getattr(self, "_fp8_path", None)
        site = rules_lib.Site(rule, functools.partial(_raw_convert, self, rule, counts),
                               weights=weights, path=path, module_type=type(self).__name__,
                               rule_path=path)
        with interception.converting(getattr(self, "_fp8_root", type(self)),
                                     type(self).__name__, site):
            return method(self, *args, **kwargs)
    return converting


@functools.cache
def _converting_class(cls: type, rule: rules_lib.Fp8Rule | None) -> type:
    new = type(cls.__name__, (cls,), {"__call__": _converting_call(cls.__call__, rule),
                                      "_fp8_unconverted": cls})
    new.__qualname__, new.__module__ = cls.__qualname__, cls.__module__
    return new


def convert(model: nnx.Module, rules: Any = None, *example_args: Any,
            **example_kwargs: Any) -> nnx.Module:
    """`jax_fp8.flax.fp8_model` for an NNX ``model``: converted in place and returned."""
    rules = rules_lib.as_rules(rules)
    # What a converted module reports under (Fp8ConversionWarning): once per model.
    root = f"{type(model).__name__} at {id(model):#x}"
    for path, module in list(nnx.iter_modules(model)):
        name = "/".join(str(p) for p in path)
        rule = rules_lib.rule_for(rules, name)
        if isinstance(module, (Fp8DotGeneral, Fp8Einsum)):
            continue
        if isinstance(module, _LAYERS):
            if rule is not None:
                _convert(module, rule, name)
        else:   # its __call__ converts its own GEMMs (rule None: marks them unconverted)
            cls = getattr(type(module), "_fp8_unconverted", type(module))
            # Flax's own modules have no GEMM of a parameter but those of their layers.
            if not cls.__module__.startswith("flax.") and \
                    any("__call__" in vars(k) for k in cls.__mro__[:-1]):
                module.__class__ = _converting_class(cls, rule)
                # Static attributes: they survive nnx.split / merge (jit, scan, ...).
                setattr(module, "_fp8_path", name)  # noqa: B010
                setattr(module, "_fp8_root", root)  # noqa: B010
    if example_args or example_kwargs:
        model(*example_args, **example_kwargs)
    return model
