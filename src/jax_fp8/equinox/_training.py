"""The Equinox training step's helpers: the optimizer's view of a model (`params`), the step
(`apply_updates`: optimizer updates for the parameters, ONE fused FP8 update for the
states), microbatches (`accumulate_grads`), and the loop's check (`check_fp8_updated`)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_fp8 import _trace_checks, meta as meta_lib
from jax_fp8.equinox._state import FIX, Fp8Placeholder, Fp8State, is_fp8_node
from jax_fp8.meta import combine_fp8_grads, new_fp8_state

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


def _new_states(model, grads, axis_name=None) -> list[Fp8State]:
    held = fp8_states(model)
    got = dict(fp8_states(grads))
    delayed = [(p, s) for p, s in held if not s.meta.stateless]
    missing = [p for p, _ in delayed if p not in got]
    if missing and not _trace_checks.scales_frozen():
        raise ValueError(
            f"jax_fp8.equinox.apply_updates: grads has no gradient for the FP8 state "
            f"{missing[0]} ({len(missing)} of the model's {len(delayed)} delayed-scaling "
            f"states), whose scales would then never change. Pass the whole gradient tree "
            f"of eqx.filter_value_and_grad(loss_fn)(model, ...) (not params(grads)), with the "
            f"FP8 states differentiated (the default filter, eqx.is_inexact_array). To keep "
            f"the scales frozen on purpose, call it inside `with jax_fp8.frozen_scales():`. "
            + FIX)
    if missing:
        return [s for _, s in held]
    _trace_checks.check_amaxes_reduced(axis_name, "jax_fp8.equinox.apply_updates")
    # ONE update_states call per recipe (a model converted with one recipe: one call).
    groups: dict = {}
    for i, (_, s) in enumerate(delayed):
        groups.setdefault(s.recipe, []).append(i)
    new = {p: s for p, s in held}
    for recipe, idx in groups.items():
        metas = [delayed[i][1].meta for i in idx]
        grad_metas = [got[delayed[i][0]].meta for i in idx]
        updated = new_fp8_state(metas, grad_metas, recipe, axis_name=axis_name)
        for i, meta in zip(idx, updated):
            p, s = delayed[i]
            new[p] = Fp8State(meta, s.recipe)
    return [new[p] for p, _ in held]


def apply_updates(model: Any, updates: Any, grads: Any, *, axis_name: Any = None) -> Any:
    """One training step's new model: the optimizer's ``updates`` added to the parameters
    (as ``eqx.apply_updates``) and every FP8 state updated from ``grads`` by ONE fused
    update (`jax_fp8.update_states`, one call per recipe).

    Args:
      model: the model (with `Fp8Linear` layers / converted by `fp8_model`).
      updates: the optimizer's updates for ``params(model)`` (an `Fp8Placeholder` or
        None where an FP8 state stands).
      grads: the whole gradient tree of ``eqx.filter_value_and_grad(loss_fn)(model,
        ...)``: its FP8 states' gradients carry the amaxes the step observed.
      axis_name: inside ``jax.pmap`` (or ``shard_map``), the mapped axis (or axes) whose
        devices' amaxes the update max-reduces first (one ``pmax``); required under
        ``pmap``.

    Raises:
      ValueError: ``grads`` holds no gradient for a delayed-scaling state (its scales
        would never change), unless traced inside `jax_fp8.frozen_scales` (then the FP8
        states are kept as they are); or traced inside ``jax.pmap`` without
        ``axis_name``.
    """
    new_states = iter(_new_states(model, grads, axis_name))
    held = jax.tree.map(lambda x: Fp8Placeholder() if isinstance(x, Fp8State) else x, model,
                        is_leaf=is_fp8_node)

    def step(update, value):
        if update is None or isinstance(update, Fp8Placeholder):
            return value
        return (value + update).astype(jnp.result_type(value))

    stepped = jax.tree.map(step, updates, held,
                           is_leaf=lambda x: x is None or isinstance(x, Fp8Placeholder))
    return jax.tree.map(lambda x: next(new_states) if isinstance(x, Fp8Placeholder) else x,
                        stepped, is_leaf=is_fp8_node)


def accumulate_grads(total: Any, grads: Any) -> Any:
    """Two gradient trees of microbatches combined: parameter gradients summed, the FP8
    states' gradients (observed amaxes) combined by max (`jax_fp8.combine_fp8_grads`), so
    that `apply_updates` after several microbatches sees the max amax of all of them.
    (Summing whole gradient trees, ``jax.tree.map(jnp.add, ...)``, would add the amaxes.)"""
    def add(a, b):
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
    try:
        meta_lib.check_fp8_updated(states, type(model).__name__)
    except ValueError as err:
        raise ValueError(f"{err} (Equinox: {FIX})") from None
