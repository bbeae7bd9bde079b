"""The NNX training step's FP8 half: FP8 gradients, the fused update, `Fp8Optimizer`.

`fp8_value_and_grad` differentiates a loss w.r.t. the parameters and the `Fp8State`s
(whose "gradients" are the observed amaxes, as `Fp8Grad`s); `Fp8Optimizer.update`,
`apply_gradients` and `update_fp8` turn them into the next FP8 state with one fused
update; `check_fp8_updated` tells a model whose states were never updated. Part of
`jax_fp8.flax.nnx`, which re-exports every public name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jax_fp8 import (
    _fp8_grads,
    _trace_checks,
    meta as meta_lib,
    recipe as recipe_lib,
    state as state_lib,
)
from jax_fp8.flax import multi_steps
from jax_fp8.flax._nnx_layers import _FP8_GRADS, Fp8Grad, Fp8State, _get, _set
from jax_fp8.meta import new_fp8_state
from jax_fp8.recipe import check_recipe


def fp8_state(model: nnx.Module | nnx.State) -> nnx.State:
    """The model's FP8 state (every `Fp8State`), as an ``nnx.State``; of a gradient
    ``nnx.State``, its FP8 part (its `Fp8Grad`s as `Fp8State`s, the structure of the
    model's FP8 state)."""
    if isinstance(model, nnx.Module):
        return nnx.state(model, Fp8State)
    return _as_states(nnx.state(model, _FP8_GRADS))


def update_fp8(model: nnx.Module, fp8_grads: Any, recipe: recipe_lib.Recipe | None = None,
               *, axis_name: Any = None) -> None:
    """Replaces every `Fp8State` of ``model`` with ONE fused ``update_states`` call.

    Args:
      model: the NNX module whose `Fp8State`s are replaced, in place.
      fp8_grads: the gradient w.r.t. the model's `Fp8State`s, or the whole gradient of
        `fp8_value_and_grad` (its FP8 part is used).
      recipe: the recipe the layers were made with (default ``DelayedScaling()``, as in
        linen): every state must follow it (history length, FP8 dtypes), else
        ValueError. A current or blockwise recipe keeps no state: the model must then
        hold none (there is nothing to update); on delayed-scaling states it is a
        ValueError.
      axis_name: inside ``jax.pmap`` / ``shard_map``, the mapped axis (or axes) whose
        devices' amaxes are max-reduced first (one ``pmax``); required under ``pmap``.

    Returns:
      The new FP8 state (an ``nnx.State``), now also the model's.
    """
    if isinstance(fp8_grads, nnx.State):
        fp8_grads = fp8_state(fp8_grads)
    _trace_checks.check_amaxes_reduced(axis_name, "update_fp8")
    new = new_fp8_state(fp8_state(model), fp8_grads, recipe, axis_name=axis_name)
    nnx.update(model, new)
    return new


def _split(grads):
    """(the FP8 part, the rest) of a gradient ``nnx.State``."""
    if hasattr(nnx, "split_state"):
        return nnx.split_state(grads, _FP8_GRADS, ...)
    return grads.split(_FP8_GRADS, ...)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _retyped(tree, cls):
    """``tree`` (an ``nnx.State``) with each variable as a ``cls`` of the same value."""
    return jax.tree.map(lambda v: cls(_get(v)) if _is_variable(v) else v, tree,
                        is_leaf=_is_variable)


def _as_states(fp8_grads):
    """The FP8 part of a gradient, typed as the model's `Fp8State`s (its structure)."""
    return _retyped(fp8_grads, Fp8State)


def fp8_value_and_grad(loss_fn: Callable, has_aux: bool = False, wrt: Any = nnx.Param,
                       ) -> Callable[..., tuple[Any, nnx.State]]:
    """``loss_fn(model, *args)`` -> f(model, *args) = ``(loss[, aux]), grads``.

    ``grads`` is the ``nnx.State`` of the gradients w.r.t. the ``wrt`` variables and the
    `Fp8State`s, the latter as `Fp8Grad` variables holding `jax_fp8.AmaxGrad`s (which
    refuse arithmetic: apply gradient transforms to the ``nnx.Param`` part): what
    `apply_gradients`,
    `Fp8Optimizer.update` and `update_fp8` take (linen's
    `jax_fp8.flax.fp8_value_and_grad` returns the same ``(loss[, aux]), grads``). A plain
    ``nnx.Optimizer`` given these gradients refuses them at trace time (`Fp8Grad`).
    """
    diff = nnx.DiffState(0, nnx.Any(wrt, Fp8State))
    value_and_grad = nnx.value_and_grad(loss_fn, argnums=diff, has_aux=has_aux)

    @functools.wraps(loss_fn)
    def f(*args, **kwargs):
        value, grads = value_and_grad(*args, **kwargs)
        return value, jax.tree.map(
            lambda v: Fp8Grad(_fp8_grads.fp8_grads_from_cotangents(_get(v)))
            if isinstance(v, Fp8State) else v, grads, is_leaf=_is_variable)

    return f


def apply_gradients(model: nnx.Module, optimizer: nnx.Optimizer, grads: nnx.State,
                    recipe: recipe_lib.Recipe | None = None, *, axis_name: Any = None,
                    **kwargs: Any) -> None:
    """``optimizer.update(model, <param gradients>)`` and `update_fp8` with the FP8 ones.

    Args:
      model: the model ``optimizer`` was made for.
      optimizer: an ``nnx.Optimizer`` (``wrt=nnx.Param``); ``kwargs`` go to its update.
      grads: as `fp8_value_and_grad` returns them (both parts in one ``nnx.State``).
      recipe: as in `update_fp8`.
      axis_name: as in `update_fp8` (required under ``jax.pmap``).

    Raises:
      ValueError: the model holds delayed-scaling states and ``grads`` has no gradient for
        them (their scales would never change), unless inside `jax_fp8.frozen_scales`
        (then only the optimizer steps); ``recipe`` does not match the states (checked
        before anything changes); or ``optimizer`` wraps ``optax.MultiSteps``, which would
        update the FP8 state every microbatch: use `Fp8Optimizer`, or accumulate inside
        the step (docs/semantics.md, "Gradient accumulation").
    """
    _step(model, optimizer, grads, recipe, nnx.Optimizer.update, kwargs, axis_name)


def _step(model, optimizer, grads, recipe, optimizer_update, kwargs, axis_name=None):
    fp8_grads, param_grads = _split(grads)
    held = state_lib.states_info(fp8_state(model))
    # The recipe is checked before the optimizer steps, so a mismatch changes nothing.
    state_lib.check_states_follow(recipe_lib.default() if recipe is None else recipe,
                                  fp8_state(model), type(model).__name__)
    if held and not _fp8_grads.holds_fp8_grads(fp8_grads) and not _trace_checks.scales_frozen():
        raise ValueError(
            f"apply_gradients: grads has no FP8 gradients, but the model holds {len(held)} "
            "delayed-scaling states, whose scales would never change. Differentiate them "
            "too: `loss, grads = jax_fp8.flax.nnx.fp8_value_and_grad(loss_fn)(model, ...)` "
            "(or nnx.value_and_grad with argnums=nnx.DiffState(0, nnx.Any(nnx.Param, "
            "Fp8State))). To keep the scales frozen on purpose, call it inside "
            "`with jax_fp8.frozen_scales():`.")
    if held and not _trace_checks.scales_frozen() and \
            multi_steps.find(getattr(optimizer, "opt_state", None), "apply_gradients") is not None:
        raise ValueError(
            "apply_gradients: the optimizer wraps optax.MultiSteps, which applies once per "
            "k calls, but the FP8 state would be updated at every call. Use "
            "jax_fp8.flax.nnx.Fp8Optimizer(model, tx, wrt=nnx.Param, recipe=...) and "
            "optimizer.update(model, grads) (one FP8 update per MultiSteps step, from the max "
            "of the microbatches' amaxes), or accumulate inside the step: a lax.scan over "
            "the microbatches, combining the FP8 gradients with jax_fp8.combine_fp8_grads "
            "(docs/semantics.md, \"Gradient accumulation\").")
    if held and _fp8_grads.holds_fp8_grads(fp8_grads):
        _trace_checks.check_amaxes_reduced(axis_name, "apply_gradients")
    optimizer_update(optimizer, model, param_grads, **kwargs)
    if held and _fp8_grads.holds_fp8_grads(fp8_grads):
        update_fp8(model, fp8_grads, recipe, axis_name=axis_name)


class Fp8Pending(nnx.Variable):
    """Under ``optax.MultiSteps``: the max of the staged amaxes since the optimizer last
    applied (a list of float32 arrays, one per FP8 state in tree order)."""


class Fp8Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose ``update(model, grads)`` is `apply_gradients`.

    ``Fp8Optimizer(model, tx, wrt=nnx.Param, recipe=None)``: ``recipe`` is the one the
    layers were made with (as in `update_fp8`). Then the usual NNX loop updates the FP8
    state too, or refuses gradients without it:

        loss, grads = fp8_value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)       # params (optax) and ONE fused FP8 update

    With ``tx`` an ``optax.MultiSteps`` (alone or in a chain), the amaxes of the
    microbatches combine by max in ``fp8_pending`` (`Fp8Pending`) and the FP8 state is
    updated once, when MultiSteps applies.
    """

    def __init__(self, model, tx, *, wrt=nnx.Param, recipe=None, **kwargs):
        super().__init__(model, tx, wrt=wrt, **kwargs)
        self.fp8_recipe = None if recipe is None else check_recipe(recipe)
        pending = multi_steps.zero_pending(fp8_state(model), self.opt_state, "Fp8Optimizer")
        self.fp8_pending = None if pending is None else Fp8Pending(pending)

    def update(self, model: nnx.Module, grads: nnx.State, /, *, axis_name: Any = None,
               **kwargs: Any) -> None:
        """The optimizer step on the ``wrt`` gradients and `update_fp8` on the FP8 ones
        (errors and ``axis_name`` as `apply_gradients`; under MultiSteps, see the class)."""
        if self.fp8_pending is None:
            _step(model, self, grads, self.fp8_recipe, nnx.Optimizer.update, kwargs, axis_name)
            return
        recipe = recipe_lib.default() if self.fp8_recipe is None else self.fp8_recipe
        states = fp8_state(model)
        state_lib.check_states_follow(recipe, states, type(model).__name__)
        fp8_grads, param_grads = _split(grads)
        if _trace_checks.scales_frozen():  # the FP8 state and its pending amaxes are kept
            nnx.Optimizer.update(self, model, param_grads, **kwargs)
            return
        if not _fp8_grads.holds_fp8_grads(fp8_grads):
            _step(model, self, grads, self.fp8_recipe, nnx.Optimizer.update, kwargs)
            return  # (raises)
        _trace_checks.check_amaxes_reduced(axis_name, "Fp8Optimizer.update")
        before = multi_steps.gradient_step(self.opt_state, "Fp8Optimizer")
        nnx.Optimizer.update(self, model, param_grads, **kwargs)
        applied = multi_steps.gradient_step(self.opt_state, "Fp8Optimizer") != before
        pure = nnx.as_pure(states) if hasattr(nnx, "as_pure") else states
        new, pending = multi_steps.accumulate(pure, fp8_grads, _get(self.fp8_pending), applied,
                                              recipe, axis_name)
        nnx.update(model, new)
        _set(self.fp8_pending, pending)


_JAX_JIT = (" NNX: or the step was jitted with `jax.jit` instead of `nnx.jit`: a "
            "`jax.jit` function's changes to the module it was given (the optimizer's and "
            "the FP8 update's) are lost on return (Flax's own behaviour: the parameters did "
            "not train either); use `@nnx.jit`, or `nnx.split` the model, `nnx.merge` it "
            "inside the step and return `nnx.state(model)` for `nnx.update`.")


def check_fp8_updated(model: nnx.Module) -> None:
    """Raises ValueError when ``model`` holds delayed-scaling states and none was ever
    updated (`jax_fp8.check_fp8_updated`): call it outside ``jit`` after a few steps.
    The message also names NNX's own cause: a step jitted with ``jax.jit`` rather than
    ``nnx.jit``, whose changes to the model are lost."""
    try:
        meta_lib.check_fp8_updated(fp8_state(model), type(model).__name__)
    except ValueError as err:
        if "was ever updated" not in str(err):
            raise
        raise ValueError(str(err) + _JAX_JIT) from None
