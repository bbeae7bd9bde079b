"""FP8 for an NNX model you did not write: the NNX `fp8_model` converter."""

from __future__ import annotations

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


def fp8_model(model: nnx.Module, rules=None):
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
    along their kernel's leading axes. Other GEMMs (a module's own ``x @ w``,
    ``jnp.einsum`` or ``jax.lax.dot_general``, the attention scores of
    ``nnx.MultiHeadAttention``) stay as they are; its projections are ``LinearGeneral``s
    and convert.

    Args:
      model: an ``nnx.Module``.
      rules: an `jax_fp8.flax.Fp8Rule`, a sequence of them, or None (``Fp8Rule()``:
        every layer, delayed scaling).

    Returns:
      ``model`` itself (converted in place). Its ``nnx.Param``s are unchanged (same
      paths and values); train it with `fp8_value_and_grad` and `update_fp8` (or the
      optimizer of `jax_fp8.flax.nnx`) as a hand-written FP8 model.

    Raises:
      TypeError: ``model`` is not an NNX module, or a bad rule.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"jax_fp8.flax.nnx.fp8_model(model): model must be an flax.nnx "
                        f"Module, got {type(model).__name__} (for a linen model use "
                        f"jax_fp8.flax.fp8_model)")
    rules = conversion.as_rules(rules)
    layers = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
    found = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, layers)]
    for path, module in found:
        rule = conversion.rule_for(rules, "/".join(str(p) for p in path))
        if rule is not None:
            _convert(module, rule)
    return model
