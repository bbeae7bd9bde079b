"""The Equinox training step's helpers: the optimizer's view of a model (`params`), the step
(`apply_updates`: optimizer updates for the parameters, ONE fused FP8 update for the
states), microbatches (`accumulate_grads`), and the loop's check (`check_fp8_updated`)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_fp8 import _training_step, meta as meta_lib
from jax_fp8._training_step import Fp8Part
from jax_fp8.equinox._state import EQUINOX, Fp8Placeholder, Fp8State, is_fp8_node
from jax_fp8.meta import combine_fp8_grads

__all__ = ["accumulate_grads", "apply_updates", "check_fp8_updated", "fp8_states", "params"]



def params(tree: Any) -> Any:
    """What an optimizer is given of a model (or of its gradient): its float arrays, with
    an `Fp8Placeholder` where each FP8 state stands (``eqx.filter(tree,
    eqx.is_inexact_array)`` with the FP8 states held out).

    Use it for ``optim.init(params(model))`` and ``optim.update(params(grads), opt_state,
    params(model))``; the FP8 states are updated by `apply_updates`."""
    held = jax.tree.map(lambda x: Fp8Placeholder() if isinstance(x, Fp8State) else x, tree,
                        is_leaf=is_fp8_node)
    return eqx.filter(held, eqx.is_inexact_array)


def fp8_states(tree: Any) -> list[tuple[str, Fp8State]]:
    """``(path, state)`` of every `Fp8State` in ``tree`` (a model or a gradient tree), in
    tree order; ``path`` as ``jax.tree_util.keystr`` writes it."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_fp8_node)[0]
    return [(jax.tree_util.keystr(p), x) for p, x in leaves if isinstance(x, Fp8State)]


def _parts(model: Any, grads: Any
           ) -> tuple[list[tuple[str, Fp8State]], list[Fp8Part], list[str]]:
    """The model's FP8 states (path, state), its delayed-scaling ones as one `Fp8Part` per
    recipe (states and gradients by path), and the paths without a gradient."""
    held = fp8_states(model)
    got = dict(fp8_states(grads))
    by_recipe: dict[Any, list[str]] = {}
    for p, s in held:
        if not s.meta.stateless:
            by_recipe.setdefault(s.recipe, []).append(p)
    missing = [p for ps in by_recipe.values() for p in ps if p not in got]
    states = dict(held)
    parts = [Fp8Part(recipe, {p: states[p].meta for p in ps},
                     None if missing else {p: got[p].meta for p in ps})
             for recipe, ps in by_recipe.items()]
    return held, parts, missing


def apply_updates(model: Any, updates: Any, grads: Any, *, opt_state: Any = None,
                  axis_name: Any = None) -> Any:
    """One training step's new model: the optimizer's ``updates`` added to the parameters
    (as ``eqx.apply_updates``) and every FP8 state updated from ``grads`` by ONE fused
    update (`jax_fp8.update_states`, one call per recipe).

    Args:
      model: the model (with `Fp8Linear` layers / converted by `fp8_model`).
      updates: the optimizer's updates for ``params(model)`` (an `Fp8Placeholder` or
        None where an FP8 state stands).
      grads: the whole gradient tree of ``eqx.filter_value_and_grad(loss_fn)(model,
        ...)``: its FP8 states' gradients carry the amaxes the step observed.
      opt_state: the optimizer state ``optim.update`` returned with ``updates``; given, an
        optimizer that wraps ``optax.MultiSteps`` (which applies once per k calls, while
        this would update the FP8 states at every call) is refused, naming the fix.
      axis_name: inside ``jax.pmap`` (or ``shard_map``), the mapped axis (or axes) whose
        devices' amaxes the update max-reduces first (one ``pmax``); required under
        ``pmap``.

    Raises:
      ValueError: in the order of every adapter's step (`jax_fp8._training_step`): an FP8
        state's meta does not follow the recipe it carries; ``grads`` holds no gradient
        for a delayed-scaling state (its scales would never change), unless traced inside
        `jax_fp8.frozen_scales` (then the FP8 states are kept as they are); or traced
        inside ``jax.pmap`` without ``axis_name``; ``opt_state`` holds an
        ``optax.MultiSteps`` (accumulate the microbatches' gradients with
        `accumulate_grads` and call this once per optimizer step).
    """
    held, parts, missing = _parts(model, grads)
    placed = jax.tree.map(lambda x: Fp8Placeholder() if isinstance(x, Fp8State) else x, model,
                          is_leaf=is_fp8_node)

    def step(update: Any, value: Any) -> Any:
        if update is None or isinstance(update, Fp8Placeholder):
            return value
        return (value + update).astype(jnp.result_type(value))

    def optimizer_step() -> tuple[Any, None]:
        return jax.tree.map(step, updates, placed,
                            is_leaf=lambda x: x is None or isinstance(x, Fp8Placeholder)), None

    stepped, updated, _ = _training_step.step(
        EQUINOX.at("jax_fp8.equinox.apply_updates"), parts, optimizer_step,
        name=type(model).__name__, missing=missing, opt_state=opt_state, axis_name=axis_name)
    new = dict(held)
    for part, metas in zip(parts, updated):
        for p, meta in metas.items():
            new[p] = Fp8State(meta, part.recipe)
    states = iter(new[p] for p, _ in held)
    return jax.tree.map(lambda x: next(states) if isinstance(x, Fp8Placeholder) else x,
                        stepped, is_leaf=is_fp8_node)


def accumulate_grads(total: Any, grads: Any) -> Any:
    """Two gradient trees of microbatches combined: parameter gradients summed, the FP8
    states' gradients (observed amaxes) combined by max (`jax_fp8.combine_fp8_grads`), so
    that `apply_updates` after several microbatches sees the max amax of all of them.
    (Summing whole gradient trees, ``jax.tree.map(jnp.add, ...)``, would add the amaxes.)"""
    def add(a: Any, b: Any) -> Any:
        if isinstance(a, Fp8State):
            return Fp8State(combine_fp8_grads(a.meta, b.meta), a.recipe)
        if a is None:
            return None
        return a + b
    return jax.tree.map(add, total, grads, is_leaf=lambda x: x is None or is_fp8_node(x))


def check_fp8_updated(model: Any) -> None:
    """Raises ValueError when the model's delayed-scaling states show a loop that does not
    update them (`jax_fp8.check_fp8_updated`: none ever updated, or a negative amax an
    optimizer wrote). Call it on concrete values after a few steps."""
    states = {p: s.meta for p, s in fp8_states(model)}
    meta_lib.check_fp8_updated(states, type(model).__name__, hints=EQUINOX)
