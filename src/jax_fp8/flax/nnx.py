"""Flax NNX: FP8 delayed-scaling dot_general / Linear with the state in an nnx.Variable.

Usage::

    model = MyModel(...)   # built with jax_fp8.flax.nnx.Fp8Linear, or
                           # nnx.Linear(..., dot_general=Fp8DotGeneral(recipe))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads, fp8_grads = fp8_value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)            # params only
        update_fp8(model, fp8_grads, recipe)      # ONE update_states for the whole model
        return loss

Every FP8 tensor's state is an `Fp8State` variable (an ``nnx.Variable`` subtype) holding a
`ScalingState`; ``nnx.Optimizer(..., wrt=nnx.Param)`` never touches it. A module called
several times per step threads its state (it writes the meta it got back to its
variables), so the amaxes of all calls combine by max (see `jax_fp8.meta`).
"""

from __future__ import annotations

from typing import Callable

from flax import nnx

from jax_fp8 import recipe as recipe_lib
from jax_fp8.dot_general import check_min_fp8_flops, fp8_dot_general
from jax_fp8.einsum import fp8_einsum
from jax_fp8.meta import Fp8Meta, new_fp8_state
from jax_fp8.state import ScalingState

_NAMES = ("input", "kernel", "grad")


class Fp8State(nnx.Variable):
    """The delayed-scaling state (a `ScalingState`) of one FP8 tensor."""


def _get(var):
    return var.get_value() if hasattr(var, "get_value") else var.value


def _set(var, value):
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:
        var.value = value


class _Fp8Base(nnx.Module):
    def __init__(self, recipe=None, *, min_fp8_flops: float = 0):
        recipe = recipe_lib.DelayedScaling() if recipe is None else recipe
        recipe_lib.check_recipe(recipe, "recipe")
        self.min_fp8_flops = check_min_fp8_flops(min_fp8_flops)  # a static float
        meta = Fp8Meta.create(recipe)
        self.stateless_recipe = meta.recipe  # None for delayed scaling (static)
        if not meta.stateless:
            self.input = Fp8State(meta.input)
            self.kernel = Fp8State(meta.kernel)
            self.grad = Fp8State(meta.grad)

    @property
    def meta(self) -> Fp8Meta:
        if self.stateless_recipe is not None:
            return Fp8Meta(recipe=self.stateless_recipe)
        return Fp8Meta(*(_get(getattr(self, n)) for n in _NAMES))

    def _thread(self, meta: Fp8Meta):
        if meta.stateless:
            return
        for n in _NAMES:
            _set(getattr(self, n), getattr(meta, n))


class Fp8DotGeneral(_Fp8Base):
    """A stateful FP8 ``dot_general``: pass an instance as ``nnx.Linear(dot_general=...)``.

    One instance per layer (its state is that layer's). ``min_fp8_flops``: GEMMs with
    fewer FLOPs run in the operands' dtype (`jax_fp8.fp8_dot_general`).
    """

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        del kwargs  # out_sharding, ...
        out, meta = fp8_dot_general(lhs, rhs, dimension_numbers, self.meta, precision,
                                    preferred_element_type, min_fp8_flops=self.min_fp8_flops)
        self._thread(meta)
        return out


class Fp8Einsum(_Fp8Base):
    """A stateful two-operand FP8 einsum: ``Fp8Einsum()("bsd,dh->bsh", x, kernel)``."""

    def __call__(self, eqn, lhs, rhs, precision=None, preferred_element_type=None):
        del precision
        out, meta = fp8_einsum(eqn, lhs, rhs, self.meta,
                               preferred_element_type=preferred_element_type,
                               min_fp8_flops=self.min_fp8_flops)
        self._thread(meta)
        return out


class Fp8Linear(nnx.Linear):
    """``nnx.Linear`` whose matmul is an FP8 delayed-scaling GEMM."""

    def __init__(self, in_features: int, out_features: int, *, recipe=None,
                 min_fp8_flops: float = 0, rngs: nnx.Rngs, **kwargs):
        if "dot_general" in kwargs:
            raise TypeError("Fp8Linear sets dot_general itself")
        super().__init__(in_features, out_features, rngs=rngs,
                         dot_general=Fp8DotGeneral(recipe, min_fp8_flops=min_fp8_flops),
                         **kwargs)


def fp8_state(model) -> nnx.State:
    """The model's FP8 state (every `Fp8State`), as an ``nnx.State``."""
    return nnx.state(model, Fp8State)


def update_fp8(model, fp8_grads, recipe=None):
    """Replaces every `Fp8State` of ``model`` with ONE fused ``update_states`` call (a model
    of a stateless recipe, current or blockwise, has none: nothing to do)."""
    if recipe is not None and not isinstance(recipe_lib.check_recipe(recipe),
                                             recipe_lib.DelayedScaling):
        return fp8_state(model)
    new = new_fp8_state(fp8_state(model), fp8_grads, recipe)
    nnx.update(model, new)
    return new


def fp8_value_and_grad(loss_fn: Callable, has_aux: bool = False, wrt=nnx.Param):
    """``loss_fn(model, *args)`` -> f(model, *args) = ``(loss[, aux]), grads, fp8_grads``.

    ``grads`` is the ``nnx.State`` of the ``wrt`` variables (for ``nnx.Optimizer``),
    ``fp8_grads`` that of the `Fp8State`s (for `update_fp8`).
    """
    diff = nnx.DiffState(0, nnx.Any(wrt, Fp8State))
    vg = nnx.value_and_grad(loss_fn, argnums=diff, has_aux=has_aux)

    def f(model, *args, **kwargs):
        value, grads = vg(model, *args, **kwargs)
        fp8_grads, param_grads = nnx.split_state(grads, Fp8State, ...) \
            if hasattr(nnx, "split_state") else grads.split(Fp8State, ...)
        return value, param_grads, fp8_grads

    return f


__all__ = ["Fp8DotGeneral", "Fp8Einsum", "Fp8Linear", "Fp8State", "ScalingState", "fp8_state",
           "fp8_value_and_grad", "update_fp8"]
