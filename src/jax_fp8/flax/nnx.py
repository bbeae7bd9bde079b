"""Flax NNX: FP8 delayed-scaling dot_general / Linear with the state in an nnx.Variable.

Usage:

    model = MyModel(...)   # built with jax_fp8.flax.nnx.Fp8Linear, or
                           # nnx.Linear(..., dot_general=Fp8DotGeneral(recipe))
    optimizer = Fp8Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param, recipe=recipe)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = fp8_value_and_grad(loss_fn)(model, x, y)   # params and Fp8States
        optimizer.update(model, grads)        # optax + ONE fused FP8 update
        return loss

(or ``apply_gradients(model, optimizer, grads, recipe)`` with a plain ``nnx.Optimizer``).

Every FP8 tensor's state is an `Fp8State` variable (an ``nnx.Variable`` subtype) holding a
`ScalingState`; ``nnx.Optimizer(..., wrt=nnx.Param)`` never touches it. A module called
several times per step threads its state (it writes the meta it got back to its
variables), so the amaxes of all calls combine by max (see `jax_fp8.meta`).

A loop cannot skip the FP8 update silently: ``nnx.value_and_grad(loss_fn)(model)`` (params
only) over delayed-scaling layers raises at trace time, `apply_gradients` refuses
gradients without the FP8 ones, and `check_fp8_updated` tells a model whose states were
never updated (``jax_fp8.frozen_scales`` opts out on purpose).

Stacked layers: build them with ``nnx.vmap`` (``in_axes=0, out_axes=0`` over split
``Rngs``) and run them with ``nnx.scan`` (the model as a carry-free ``in_axes=0``
argument, or through ``nnx.split``); every `Fp8State` then has a leading layer axis, each
layer uses its own slice, and `update_fp8` updates the ``[n, L]`` stacks in one call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp8 import (
    _fp8_grads,
    _trace_checks,
    interception,
    meta as meta_lib,
    recipe as recipe_lib,
    state as state_lib,
)
from jax_fp8.dot_general import check_min_fp8_flops, fp8_dot_general, gemm_flops
from jax_fp8.einsum import fp8_einsum
from jax_fp8.flax import multi_steps
from jax_fp8.meta import Fp8Meta, new_fp8_state
from jax_fp8.ragged_dot import fp8_ragged_dot
from jax_fp8.recipe import check_recipe
from jax_fp8.state import ScalingState


class Fp8State(nnx.Variable):
    """The delayed-scaling state (a `ScalingState`) of one FP8 tensor."""


class Fp8Grad(nnx.Param):
    """In the gradients `fp8_value_and_grad` returns: the gradient w.r.t. one `Fp8State`,
    a `jax_fp8.AmaxGrad` holding the amaxes the step observed (a leaf that refuses
    arithmetic).

    An ``nnx.Param`` subtype on purpose: an optimizer that selects parameters
    (``nnx.Optimizer(model, tx, wrt=nnx.Param)``, ``wrt=nnx.Any(...)``) takes it along
    with the parameter gradients, and optax refuses it at trace time with an error
    naming `Fp8Optimizer` / `apply_gradients`, instead of dropping the FP8 update.
    `Fp8Optimizer`, `apply_gradients` and `update_fp8` take it apart from the rest.
    """


_FP8_GRADS = nnx.Any(Fp8Grad, Fp8State)  # the FP8 part of a gradient nnx.State


def _get(var):
    return var.get_value() if hasattr(var, "get_value") else var.value


def _set(var, value):
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:
        var.value = value


class _Fp8Base(nnx.Module):
    def __init__(self, recipe=None, *unexpected, min_fp8_flops: float = 0, **unexpected_kw):
        if unexpected or unexpected_kw or hasattr(recipe, "shape"):
            name = type(self).__name__
            raise TypeError(
                f"{name} was called as a function with arrays: it holds the FP8 state of one "
                f"layer, so pass an instance, {name}(recipe), not the class (e.g. "
                f"nnx.Linear(..., dot_general=Fp8DotGeneral(recipe)), or Fp8Linear(..., "
                f"recipe=recipe))")
        recipe = recipe_lib.default() if recipe is None else recipe
        recipe_lib.check_recipe(recipe, "recipe")
        self.min_fp8_flops = check_min_fp8_flops(min_fp8_flops)  # a static float
        meta = Fp8Meta.create(recipe)
        self.stateless_recipe = meta.recipe  # None for delayed scaling (static)
        if not meta.stateless:
            self.input = Fp8State(meta.input)
            self.kernel = Fp8State(meta.kernel)
            self.grad = Fp8State(meta.grad)

    def _report(self, kind: str, lhs, rhs, flops) -> None:
        # The FP8 layer fp8_model gave a module: reported (Fp8ConversionWarning) when it
        # keeps a GEMM below min_fp8_flops. Its report: (path, module type, rule), static.
        report = getattr(self, "_fp8_report", None)
        if report is not None and self.min_fp8_flops:
            path, module_type, rule = report
            interception.note_gemm(interception.Site(rule, None, path=path,
                                                     module_type=module_type),
                                   kind, lhs, rhs, flops())

    @property
    def meta(self) -> Fp8Meta:
        if self.stateless_recipe is not None:
            return Fp8Meta(recipe=self.stateless_recipe)
        return Fp8Meta(*(_get(getattr(self, n)) for n in Fp8Meta.STATES))

    def _thread(self, meta: Fp8Meta):
        # The returned meta carries the same values as the one read; it is written back
        # so that a second call's amaxes chain into the first's (max, not sum) when the
        # state is differentiated. A call that cannot write to the variables (a sampler's
        # `lax.while_loop` / `fori_loop` body closing over the model) and is not
        # differentiated has nothing to thread: the variables keep their values.
        if meta.stateless:
            return
        # The variables still hold the meta the call read: differentiated or not.
        differentiated = any(_trace_checks._ad_trace(x) is not None
                             for x in jax.tree.leaves(self.meta))
        for n in Fp8Meta.STATES:
            var = getattr(self, n)
            if not differentiated and not getattr(var, "_can_update", True):
                continue
            _set(var, getattr(meta, n))


class Fp8DotGeneral(_Fp8Base):
    """A stateful FP8 ``dot_general``: pass an instance as ``nnx.Linear(dot_general=...)``.

    One instance per layer (its state is that layer's). ``min_fp8_flops``: GEMMs with
    fewer FLOPs run in the operands' dtype (`jax_fp8.fp8_dot_general`).
    """

    def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                 precision: Any = None, preferred_element_type: Any = None,
                 **kwargs: Any) -> jax.Array:
        del kwargs  # out_sharding, ...
        self._report("dot_general", lhs, rhs,
                     lambda: gemm_flops(lhs.shape, rhs.shape, dimension_numbers))
        # Its own GEMMs are not a converted module's (fp8_model's interception).
        with interception.running(None):
            out, meta = fp8_dot_general(lhs, rhs, dimension_numbers, self.meta, precision,
                                        preferred_element_type,
                                        min_fp8_flops=self.min_fp8_flops)
        self._thread(meta)
        return out


class Fp8Einsum(_Fp8Base):
    """A stateful two-operand FP8 einsum: ``Fp8Einsum()("bsd,dh->bsh", x, kernel)``; an
    instance serves as ``nnx.Einsum(einsum_op=...)``."""

    def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
                 preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        del precision, kwargs  # out_sharding (nnx.Einsum passes it to its einsum_op), ...
        explicit = interception.explicit_einsum(eqn, jnp.shape(lhs), jnp.shape(rhs))
        if explicit is not None:
            self._report("einsum", lhs, rhs, lambda: interception.einsum_flops(
                explicit, jnp.shape(lhs), jnp.shape(rhs)))
        with interception.running(None):
            out, meta = fp8_einsum(eqn, lhs, rhs, self.meta,
                                   preferred_element_type=preferred_element_type,
                                   min_fp8_flops=self.min_fp8_flops)
        self._thread(meta)
        return out


class Fp8RaggedDot(_Fp8Base):
    """A stateful FP8 ``jax.lax.ragged_dot`` of a mixture-of-experts layer's expert weights
    (`jax_fp8.fp8_ragged_dot`): ``Fp8RaggedDot(recipe, num_groups=G)(x, w, group_sizes)``
    for x [M, K] and w [G, K, N]. Delayed scaling keeps one state per expert (leading axis
    G) for the input, the weight and the gradient."""

    def __init__(self, recipe=None, *unexpected, num_groups: int, min_fp8_flops: float = 0,
                 **unexpected_kw):
        super().__init__(recipe, *unexpected, min_fp8_flops=min_fp8_flops, **unexpected_kw)
        if self.stateless_recipe is None:
            for name in Fp8Meta.STATES:
                var = getattr(self, name)
                var.set_value(jax.tree.map(
                    lambda x: jax.numpy.array(jax.numpy.broadcast_to(
                        x, (int(num_groups),) + x.shape)), _get(var)))

    def __call__(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                 precision: Any = None, preferred_element_type: Any = None,
                 **kwargs: Any) -> jax.Array:
        out, meta = fp8_ragged_dot(lhs, rhs, group_sizes, self.meta, precision=precision,
                                   preferred_element_type=preferred_element_type,
                                   min_fp8_flops=self.min_fp8_flops, **kwargs)
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



__all__ = ["Fp8DotGeneral", "Fp8Einsum", "Fp8Grad", "Fp8Linear", "Fp8Optimizer", "Fp8RaggedDot",
           "Fp8Pending", "Fp8State", "ScalingState", "apply_gradients", "check_fp8_updated",
           "fp8_state", "fp8_value_and_grad", "update_fp8"]
