"""FP8 for an NNX model you did not write: the NNX `fp8_model` converter."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp8.flax import conversion
from jax_fp8.flax.nnx import Fp8DotGeneral, Fp8Einsum

__all__ = ["fp8_model"]


class Fp8EinsumOp(Fp8Einsum):
    """`Fp8Einsum` as ``nnx.Einsum``'s ``einsum_op`` (which also passes ``out_sharding``,
    ignored as by `Fp8DotGeneral`)."""

    def __call__(self, eqn, lhs, rhs, precision=None, preferred_element_type=None,
                 **kwargs):
        del kwargs
        return super().__call__(eqn, lhs, rhs, precision, preferred_element_type)


def _value(var):
    return var.get_value() if hasattr(var, "get_value") else var.value


def _stacked(layer, lead: tuple):
    """``layer`` with its FP8 states broadcast to the leading axes ``lead`` of a stacked
    (``nnx.vmap``-created) layer's kernel: the states ``nnx.vmap`` would have made."""
    if lead:
        for name in ("input", "kernel", "grad"):
            var = getattr(layer, name, None)
            if var is not None:
                var.set_value(jax.tree.map(
                    lambda x: jnp.array(jnp.broadcast_to(x, lead + x.shape)), _value(var)))
    return layer


def _convert(module, rule) -> bool:
    """Gives one ``nnx.Linear`` / ``LinearGeneral`` / ``Einsum`` an FP8 GEMM of ``rule``;
    False where the module keeps its own (a custom ``dot_general`` / ``einsum_op``)."""
    kernel = _value(module.kernel)
    if isinstance(module, nnx.Linear):
        if module.dot_general is not conversion.ORIGINAL["dot_general"]:
            return False
        layer, lead, attr = Fp8DotGeneral, kernel.shape[:-2], "dot_general"
    elif isinstance(module, nnx.LinearGeneral):
        if module.dot_general is not None or module.dot_general_cls is not None:
            return False
        n = len(module.batch_axis) + len(module.in_features) + len(module.out_features)
        layer, lead, attr = Fp8DotGeneral, kernel.shape[:kernel.ndim - n], "dot_general"
    elif isinstance(module, nnx.Einsum):
        if module.einsum_op is not conversion.ORIGINAL["einsum"]:
            return False
        n = len(module.kernel_shape)
        layer, lead, attr = Fp8EinsumOp, kernel.shape[:kernel.ndim - n], "einsum_op"
    else:
        return False
    # nnx.data: the attribute, a function before, now holds a module (as in Fp8Linear).
    setattr(module, attr, nnx.data(_stacked(
        layer(rule.recipe, min_fp8_flops=rule.min_fp8_flops), tuple(lead))))
    return True


_LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


def _own_params(module) -> tuple:
    return tuple(_value(v) for v in vars(module).values() if isinstance(v, nnx.Param))


def _raw_convert(module, rule, counts, kind, args, precision, preferred_element_type):
    """A module's own GEMM as the FP8 module ``Fp8DotGeneral_<i>`` / ``Fp8Einsum_<i>`` of
    ``module`` (the i-th of its kind in the call), created at the first eager call."""
    cls = Fp8DotGeneral if kind == "dot_general" else Fp8Einsum
    name = f"{cls.__name__}_{counts[kind]}"
    counts[kind] += 1
    layer = getattr(module, name, None)
    if layer is None:
        if any(isinstance(x, jax.core.Tracer) for x in args[:3]):
            raise ValueError(
                f"jax_fp8.flax.nnx.fp8_model: {type(module).__name__} calls a {kind} with a "
                f"parameter operand that the conversion has not seen yet, inside a "
                f"transformation (jit, grad, scan, ...), where no FP8 state can be added. "
                f"Convert with example inputs, fp8_model(model, rules, *inputs), which calls "
                f"the model once to create them, or exclude the module with "
                f"Fp8Rule(path=..., recipe=None) before the other rules")
        layer = cls(rule.recipe, min_fp8_flops=rule.min_fp8_flops)
        setattr(module, name, nnx.data(layer))
    return layer(*args, precision=precision, preferred_element_type=preferred_element_type)


def _converting_call(method, rule):
    @functools.wraps(method)
    def converting(self, *args, **kwargs):
        if rule is None:   # an unmatched module: its GEMMs stay as they are
            with conversion.running(None):
                return method(self, *args, **kwargs)
        counts = {"dot_general": 0, "einsum": 0}
        site = conversion.Site(rule, functools.partial(_raw_convert, self, rule, counts),
                               weights=_own_params(self))
        with conversion.patched(), conversion.running(site):
            return method(self, *args, **kwargs)
    return converting


@functools.lru_cache(maxsize=None)
def _converting_class(cls, rule):
    new = type(cls.__name__, (cls,), {"__call__": _converting_call(cls.__call__, rule),
                                      "_fp8_unconverted": cls})
    new.__qualname__, new.__module__ = cls.__qualname__, cls.__module__
    return new


def fp8_model(model: nnx.Module, rules=None, *example_args, **example_kwargs):
    """Makes the GEMMs of the NNX ``model`` FP8, in place, the model's code unchanged.

    Every ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` of ``model`` whose path
    (attribute names joined by ``/``, e.g. ``"blocks/0/mlp/up"``) a rule matches gets
    the FP8 GEMM of that rule: ``dot_general=Fp8DotGeneral(recipe,
    min_fp8_flops=...)`` (an ``einsum_op`` for ``nnx.Einsum``), exactly the layer, the
    `Fp8State` variables and the numbers of the model written with `Fp8Linear` /
    ``nnx.Linear(..., dot_general=Fp8DotGeneral(...))``. The first matching rule decides;
    a rule with ``recipe=None`` keeps its layers as they are, as does a layer given its
    own ``dot_general`` / ``dot_general_cls`` / ``einsum_op``. Layers stacked by
    ``nnx.vmap`` (for ``nnx.scan`` over layers) get stacked FP8 states, one per layer,
    along their kernel's leading axes.

    A matched module's own ``jnp.einsum`` / ``jax.lax.dot_general`` calls in its
    ``__call__`` with one of its ``nnx.Param``s as an operand (the array it holds:
    ``self.w[...]``) become FP8 too, through a module ``Fp8Einsum_<i>`` /
    ``Fp8DotGeneral_<i>`` added to it at the first call (the parameter quantized as the
    kernel); that first call must run outside ``jit``/``grad``/``scan``: pass example
    inputs, which ``fp8_model`` feeds to the model once. Such calls of a module stacked by
    ``nnx.vmap`` cannot get states: exclude it. GEMMs of two activations stay as they
    are unless the rule says ``activations=True`` (then those run during the module's
    ``__call__``, in the Flax modules it calls included, e.g. the attention scores);
    ``x @ w`` and ``jnp.dot`` stay as they are.

    Args:
      model: an ``nnx.Module``.
      rules: an `jax_fp8.flax.Fp8Rule`, a sequence of them, or None (``Fp8Rule()``:
        every layer, delayed scaling).
      *example_args: inputs of ``model(...)``, called once (eagerly) to add the FP8
        modules of the modules' own GEMMs; none: they are added at the first eager call.
      **example_kwargs: keyword inputs of that call.

    Returns:
      ``model`` itself (converted in place). Its ``nnx.Param``s are unchanged (same
      paths and values); train it with `fp8_value_and_grad` and `update_fp8` (or the
      optimizer of `jax_fp8.flax.nnx`) as a hand-written FP8 model.

    Raises:
      TypeError: ``model`` is not an NNX module, or a bad rule.
      ValueError: at trace time, a module's own GEMM with a parameter operand, not seen
        by an eager call, runs inside a transformation.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"jax_fp8.flax.nnx.fp8_model(model): model must be an flax.nnx "
                        f"Module, got {type(model).__name__} (for a linen model use "
                        f"jax_fp8.flax.fp8_model)")
    rules = conversion.as_rules(rules)
    for path, module in list(nnx.iter_modules(model)):
        rule = conversion.rule_for(rules, "/".join(str(p) for p in path))
        if isinstance(module, (Fp8DotGeneral, Fp8Einsum)):
            continue
        if isinstance(module, _LAYERS):
            if rule is not None:
                _convert(module, rule)
        else:   # its __call__ converts its own GEMMs (rule None: marks them unconverted)
            cls = getattr(type(module), "_fp8_unconverted", type(module))
            # Flax's own modules have no GEMM of a parameter but those of their layers.
            if not cls.__module__.startswith("flax.") and \
                    any("__call__" in vars(k) for k in cls.__mro__[:-1]):
                module.__class__ = _converting_class(cls, rule)
    if example_args or example_kwargs:
        model(*example_args, **example_kwargs)
    return model
