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
from typing import TYPE_CHECKING, Any, cast

import jax
from flax import nnx

from jax_fp8 import _fp8_grads, _hints, _training_step, meta as meta_lib, recipe as recipe_lib
from jax_fp8._training_step import Fp8Part
from jax_fp8.flax._nnx_layers import _FP8_GRADS, Fp8Grad, Fp8State, _get, _set
from jax_fp8.recipe import check_recipe

if TYPE_CHECKING:
    import optax

# How NNX spells each fix of the training step's errors (jax_fp8._hints); its modules and
# Flax's NNX ones are named so that an error raised deeper finds it.
_FP8_OPTIMIZER = ("`optimizer = jax_fp8.flax.nnx.Fp8Optimizer(model, tx, wrt=nnx.Param, "
                  "recipe=recipe)` and `optimizer.update(model, grads)`")
NNX = _hints.StepHints(
    framework="NNX",
    differentiate=("`loss, grads = jax_fp8.flax.nnx.fp8_value_and_grad(loss_fn)(model, ...)` "
                   "(or nnx.value_and_grad with argnums=nnx.DiffState(0, nnx.Any(nnx.Param, "
                   "Fp8State)))"),
    update=("`jax_fp8.flax.nnx.apply_gradients(model, optimizer, grads, recipe)`, or "
            + _FP8_OPTIMIZER + ", with `recipe` the one the layers were made with"),
    optimizer=(_FP8_OPTIMIZER + ", or `jax_fp8.flax.nnx.apply_gradients(model, optimizer, "
               "grads, recipe)` (a plain nnx.Optimizer takes the FP8 gradients of "
               "fp8_value_and_grad as parameters, whatever its wrt)"),
    recipe=("pass `recipe=` to `jax_fp8.flax.nnx.apply_gradients(model, optimizer, grads, "
            "recipe)` / `Fp8Optimizer(model, tx, wrt=nnx.Param, recipe=recipe)` / "
            "`update_fp8(model, grads, recipe)`, or make the layers with the update's recipe "
            "(`Fp8Linear(..., recipe=recipe)`, `jax_fp8.flax.fp8_model(model, "
            "jax_fp8.Fp8Rule(recipe=recipe))`)"),
    param_grads="the `nnx.Param` gradients that are not `Fp8Grad`",
    multi_steps=("Use " + _FP8_OPTIMIZER + " (one FP8 update per MultiSteps step, from the "
                 "max of the microbatches' amaxes), or accumulate inside the step: a lax.scan "
                 "over the microbatches, combining the FP8 gradients with "
                 "jax_fp8.combine_fp8_grads (docs/semantics.md, \"Gradient accumulation\")."),
)
_hints.register(("flax.nnx", "jax_fp8.flax.nnx", "jax_fp8.flax.nnx_conversion",
                 "jax_fp8.flax._nnx_layers", "jax_fp8.flax._nnx_training"), NNX)


def fp8_state(model: nnx.Module | nnx.State[Any, Any]) -> nnx.State[Any, Any]:
    """The model's FP8 state (every `Fp8State`), as an ``nnx.State``; of a gradient
    ``nnx.State``, its FP8 part (its `Fp8Grad`s as `Fp8State`s, the structure of the
    model's FP8 state)."""
    if isinstance(model, nnx.Module):
        return nnx.state(model, Fp8State)
    return _as_states(nnx.state(model, _FP8_GRADS))


def update_fp8(model: nnx.Module, fp8_grads: Any, recipe: recipe_lib.Recipe | None = None,
               *, axis_name: Any = None) -> nnx.State[Any, Any]:
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
    hints = NNX.at("update_fp8")
    parts = [Fp8Part(_training_step.default_recipe(recipe), fp8_state(model), fp8_grads)]
    _training_step.check_recipes(hints, parts, type(model).__name__)
    (new,) = _training_step.fused_update(hints, parts, axis_name)
    nnx.update(model, new)
    return cast("nnx.State[Any, Any]", new)


def _split(grads: nnx.State[Any, Any]) -> tuple[nnx.State[Any, Any], ...]:
    """(the FP8 part, the rest) of a gradient ``nnx.State``."""
    if hasattr(nnx, "split_state"):
        return nnx.split_state(grads, _FP8_GRADS, ...)
    return grads.split(_FP8_GRADS, ...)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _retyped(tree: nnx.State[Any, Any], cls: type[nnx.Variable[Any]]) -> nnx.State[Any, Any]:
    """``tree`` (an ``nnx.State``) with each variable as a ``cls`` of the same value."""
    return cast("nnx.State[Any, Any]", jax.tree.map(
        lambda v: cls(_get(v)) if _is_variable(v) else v, tree, is_leaf=_is_variable))


def _as_states(fp8_grads: nnx.State[Any, Any]) -> nnx.State[Any, Any]:
    """The FP8 part of a gradient, typed as the model's `Fp8State`s (its structure)."""
    return _retyped(fp8_grads, Fp8State)


def fp8_value_and_grad(loss_fn: Callable[..., Any], has_aux: bool = False, wrt: Any = nnx.Param,
                       ) -> Callable[..., tuple[Any, nnx.State[Any, Any]]]:
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
    def f(*args: Any, **kwargs: Any) -> tuple[Any, nnx.State[Any, Any]]:
        value, grads = value_and_grad(*args, **kwargs)
        return value, jax.tree.map(
            lambda v: Fp8Grad(_fp8_grads.fp8_grads_from_cotangents(_get(v)))
            if isinstance(v, Fp8State) else v, grads, is_leaf=_is_variable)

    return f


def apply_gradients(model: nnx.Module, optimizer: nnx.Optimizer[Any], grads: nnx.State[Any, Any],
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
      ValueError: in the order of every adapter's step (`jax_fp8._training_step`), each
        before anything changes: ``recipe`` does not match the states; the model holds
        delayed-scaling states and ``grads`` has no gradient for them (their scales would
        never change), unless inside `jax_fp8.frozen_scales` (then only the optimizer
        steps); ``optimizer`` wraps ``optax.MultiSteps``, which would update the FP8 state
        every microbatch: use `Fp8Optimizer`, or accumulate inside the step
        (docs/semantics.md, "Gradient accumulation"); or traced inside ``jax.pmap``
        without ``axis_name``.
    """
    _step(model, optimizer, grads, recipe, "apply_gradients", kwargs, axis_name)


def _step(model: nnx.Module, optimizer: nnx.Optimizer[Any], grads: nnx.State[Any, Any],
          recipe: recipe_lib.Recipe | None, call: str, kwargs: dict[str, Any],
          axis_name: Any = None, pending: list[jax.Array] | None = None
          ) -> list[jax.Array] | None:
    """The training step (`jax_fp8._training_step.step`) on an NNX model: the optimizer
    updates the parameters in place, the FP8 states (and ``pending``) are replaced."""
    fp8_grads, param_grads = _split(grads)
    states = fp8_state(model)
    if pending is not None and hasattr(nnx, "as_pure"):   # for the lax.cond of the update
        states = nnx.as_pure(states)
    given = _fp8_grads.holds_fp8_grads(fp8_grads)
    opt_state = getattr(optimizer, "opt_state", None)

    def optimizer_step() -> tuple[None, Any]:
        nnx.Optimizer.update(optimizer, model, param_grads, **kwargs)
        return None, getattr(optimizer, "opt_state", None)

    _, (new,), pending = _training_step.step(
        NNX.at(call), [Fp8Part(_training_step.default_recipe(recipe), states,
                               _as_states(fp8_grads) if given else None)],
        optimizer_step, name=type(model).__name__,
        missing=[] if given else _training_step.paths(states), opt_state=opt_state,
        pending=pending, axis_name=axis_name)
    nnx.update(model, new)
    return pending


class Fp8Pending(nnx.Variable):  # type: ignore[type-arg]  # a subscripted base: another class
    """Under ``optax.MultiSteps``: the max of the staged amaxes since the optimizer last
    applied (a list of float32 arrays, one per FP8 state in tree order)."""


class Fp8Optimizer(nnx.Optimizer):  # type: ignore[type-arg]  # a subscripted base: another class
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

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *,
                 wrt: Any = nnx.Param, recipe: recipe_lib.Recipe | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model, tx, wrt=wrt, **kwargs)
        self.fp8_recipe = None if recipe is None else check_recipe(recipe)
        pending = _training_step.zero_pending(fp8_state(model), self.opt_state,
                                             "Fp8Optimizer")
        self.fp8_pending = None if pending is None else Fp8Pending(pending)

    def update(self, model: nnx.Module, grads: nnx.State[Any, Any], /, *, axis_name: Any = None,
               **kwargs: Any) -> None:
        """The optimizer step on the ``wrt`` gradients and `update_fp8` on the FP8 ones
        (errors and ``axis_name`` as `apply_gradients`; under MultiSteps, see the class)."""
        if self.fp8_pending is None:
            _step(model, self, grads, self.fp8_recipe, "Fp8Optimizer.update", kwargs, axis_name)
            return
        pending = _step(model, self, grads, self.fp8_recipe, "Fp8Optimizer.update", kwargs,
                        axis_name, _get(self.fp8_pending))
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
        meta_lib.check_fp8_updated(fp8_state(model), type(model).__name__, hints=NNX)
    except ValueError as err:
        if "was ever updated" not in str(err):
            raise
        raise ValueError(str(err) + _JAX_JIT) from None
