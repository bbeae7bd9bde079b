"""The training step's FP8 half, one policy for every adapter: linen's `Fp8TrainState`, NNX's
`apply_gradients` / `Fp8Optimizer` and Equinox's `apply_updates` call `step`.

`step` runs, in this order:

1. the recipe: every FP8 state must follow the recipe it is updated with (before anything
   changes);
2. the FP8 gradients: a delayed-scaling state without one would never change its scales,
   which is refused unless inside `jax_fp8.frozen_scales` (then the states, and their
   pending amaxes, are kept and only the optimizer steps);
3. ``optax.MultiSteps``: the optimizer applies once per k calls, so the amaxes of the
   calls in between are kept, combined by max, as *pending* amaxes (a flat list of float32
   arrays, one per state in tree order, so that it checkpoints as plain arrays whatever
   holds the states), and the update runs where the optimizer applies; a caller that holds
   no pending amaxes is refused;
4. the devices' amaxes: inside ``jax.pmap`` the update needs ``axis_name``
   (`jax_fp8._trace_checks.check_amaxes_reduced`);
5. ONE fused update (`jax_fp8.new_fp8_state`, one ``update_states`` call per recipe).

The messages name the fix in the caller's framework: each adapter passes its
`jax_fp8._hints.StepHints`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp

from jax_fp8 import _trace_checks, recipe as recipe_lib, state as state_lib
from jax_fp8._hints import StepHints
from jax_fp8.meta import amax_cotangents, new_fp8_state
from jax_fp8.update import update_states

__all__ = ["Fp8Part", "accumulate", "check_recipes", "default_recipe", "find", "fused_update",
           "gradient_step", "paths", "step", "zero_pending"]


class Fp8Part(NamedTuple):
    """The FP8 states of one recipe and their FP8 gradients (None: none were given)."""

    recipe: Any
    states: Any
    grads: Any = None


def default_recipe(recipe: Any) -> Any:
    """``recipe``, or the default recipe where it is None."""
    return recipe_lib.default() if recipe is None else recipe


def paths(states: Any) -> list[str]:
    """The tree path of every delayed-scaling state of ``states`` (``jax.tree_util.keystr``)."""
    return [jax.tree_util.keystr(p) for p, _, _ in state_lib.states_info(states)]


# ------------------------------------------------------------------------ optax.MultiSteps

def find(opt_state: Any, owner: str) -> Any:
    """The ``optax.MultiStepsState`` inside an optimizer state (any nesting: a chain, a
    named chain, NNX's optimizer state), or None.

    Raises:
      ValueError: several of them (the FP8 state can follow one accumulation only);
        `owner` names the caller in the message.
    """
    optax = sys.modules.get("optax")   # not imported: no optimizer state holds one
    if optax is None or opt_state is None:
        return None
    is_ms: Callable[[Any], bool] = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_ms) if is_ms(x)]
    if len(found) > 1:
        raise ValueError(f"{owner}: the optimizer holds {len(found)} optax.MultiSteps; the "
                         "FP8 state can follow one accumulation only (wrap the whole "
                         "optimizer in one MultiSteps)")
    return found[0] if found else None


def gradient_step(opt_state: Any, owner: str) -> jax.Array:
    """The accumulation's count of applied steps (`find`'s ``gradient_step``)."""
    found = find(opt_state, owner)
    if found is None:
        raise ValueError(f"{owner}: the optimizer state holds no optax.MultiSteps, but the FP8 "
                         "state keeps pending amaxes for one (build it with the optimizer "
                         "it is used with)")
    count = found.gradient_step
    return cast(jax.Array, count[...] if hasattr(count, "get_value") else count)


def _amax_slots(states: Any) -> Any:
    """A float32 array of each state's scale shape (where its amax goes), in its place."""
    return jax.tree.map(lambda s: s.scale if state_lib.is_state(s) else s, states,
                        is_leaf=state_lib.is_state)


def zero_pending(states: Any, opt_state: Any, owner: str) -> list[Any] | None:
    """Zero pending amaxes for the delayed-scaling states of `states` when `opt_state`
    accumulates (`find`), else None (no accumulation, or nothing to update)."""
    if not state_lib.states_info(states) or find(opt_state, owner) is None:
        return None
    return [jnp.zeros_like(a) for a in jax.tree.leaves(_amax_slots(states))]


def accumulate(states: Any, fp8_grads: Any, pending: list[Any], applied: Any, recipe: Any,
               axis_name: Any = None) -> tuple[Any, list[Any]]:
    """One call under accumulation: `fp8_grads`' amaxes combined into `pending` by max;
    where `applied` (a traced bool: the optimizer applied on this call) the states
    updated from them (max-reduced over ``axis_name`` first, when given) and the pending
    amaxes reset to zero.

    Returns:
      (the states, the pending amaxes) after this call.
    """
    staged = jax.tree.leaves(amax_cotangents(fp8_grads))
    pending = [jnp.fmax(p, a) for p, a in zip(pending, staged, strict=True)]
    amaxes = jax.tree.unflatten(jax.tree.structure(_amax_slots(states)), pending)
    states = jax.lax.cond(applied, lambda: update_states(states, amaxes, recipe=recipe,
                                                         axis_name=axis_name),
                          lambda: states)
    return states, [jnp.where(applied, jnp.zeros_like(p), p) for p in pending]


# ------------------------------------------------------------------------------ the step

def check_recipes(hints: StepHints, parts: Sequence[Fp8Part], name: str) -> None:
    """Step 1: ValueError when a state of a part does not follow the part's recipe (the
    message names ``name`` + the state's path, and ``hints``' fix)."""
    for part in parts:
        state_lib.check_states_follow(part.recipe, part.states, name, hints)


def fused_update(hints: StepHints, parts: Sequence[Fp8Part], axis_name: Any = None) -> list[Any]:
    """Steps 4 and 5: the devices' amaxes reduced where they must be, then each part's new
    states from ONE ``update_states`` call (`new_fp8_state`)."""
    _trace_checks.check_amaxes_reduced(axis_name, hints)
    return [new_fp8_state(p.states, p.grads, p.recipe, axis_name=axis_name) for p in parts]


def _no_fp8_grads(hints: StepHints, name: str, missing: Sequence[str], held: int) -> str:
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (f"{hints.call}: no FP8 gradients for the delayed-scaling states of {name}: grads "
            f"has no gradient for the FP8 state {name}{missing[0]}{more} ({held} "
            "delayed-scaling states in all), whose scales would then never change. To "
            f"update them: {hints.loop}. To keep the scales frozen on purpose, call it inside "
            "`with jax_fp8.frozen_scales():`.")


def _multi_steps(hints: StepHints) -> str:
    return (f"{hints.call}: the optimizer wraps optax.MultiSteps, which applies once per k "
            "calls, but the FP8 state would be updated at every call. "
            + (hints.multi_steps or "Accumulate inside the step: a lax.scan over the "
               "microbatches, combining their FP8 gradients with jax_fp8.combine_fp8_grads "
               "(docs/semantics.md, \"Gradient accumulation\")."))


def step(hints: StepHints, parts: Sequence[Fp8Part], optimizer_step: Callable[[], tuple[Any, ...]],
         *, name: str, missing: Sequence[str] = (), opt_state: Any = None,
         pending: list[Any] | None = None, axis_name: Any = None
         ) -> tuple[Any, list[Any], Any]:
    """One training step: the checks in the module's order, ``optimizer_step`` (the
    optimizer on the parameters), and the FP8 update.

    Args:
      hints: the caller's framework's texts, ``call`` set to the function the user called.
      parts: the FP8 states by recipe (`Fp8Part`), with their FP8 gradients.
      optimizer_step: runs the optimizer on the parameters (only once every check has
        passed); returns (the caller's result, the optimizer state after it).
      name: what messages call the FP8 state tree (a state's path follows it).
      missing: the paths of the delayed-scaling states without an FP8 gradient.
      opt_state: the optimizer state before the step (None: not known to the caller);
        under ``optax.MultiSteps`` without ``pending``, refused.
      pending: the pending amaxes (`zero_pending`), for a caller that keeps them; one part.
      axis_name: the mapped axis (or axes) over which the devices' amaxes are max-reduced.

    Returns:
      (``optimizer_step``'s result, each part's new states, the new pending amaxes).
    """
    check_recipes(hints, parts, name)
    held = sum(len(state_lib.states_info(p.states)) for p in parts)
    kept = [p.states for p in parts]
    frozen = _trace_checks.scales_frozen()
    if held and missing and not frozen:
        raise ValueError(_no_fp8_grads(hints, name, missing, held))
    if not held or missing or frozen:   # the states and their pending amaxes are kept
        return optimizer_step()[0], kept, pending
    if pending is None and find(opt_state, hints.call) is not None:
        raise ValueError(_multi_steps(hints))
    if pending is None:
        result, _ = optimizer_step()
        return result, fused_update(hints, parts, axis_name), None
    _trace_checks.check_amaxes_reduced(axis_name, hints)
    (part,) = parts
    before = gradient_step(opt_state, hints.call)
    result, after = optimizer_step()
    applied = gradient_step(after, hints.call) != before
    states, pending = accumulate(part.states, part.grads, pending, applied, part.recipe,
                                 axis_name)
    return result, [states], pending
