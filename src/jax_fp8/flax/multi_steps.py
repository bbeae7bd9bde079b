"""The FP8 state under ``optax.MultiSteps``, one logic for linen's `Fp8TrainState` and NNX's
`Fp8Optimizer`.

Under gradient accumulation the optimizer applies once every k calls. The FP8 state
follows it: the amaxes each call observes are combined by max into *pending* amaxes
(a flat list of float32 arrays, one per delayed-scaling state in tree order, so it
checkpoints as plain arrays whatever container holds the states), and the one fused
update runs on the call where the optimizer applies.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_fp8 import state as state_lib
from jax_fp8.meta import amax_cotangents
from jax_fp8.update import update_states

__all__ = ["accumulate", "find", "zero_pending"]


def find(opt_state, owner: str) -> optax.MultiStepsState | None:
    """The ``optax.MultiStepsState`` inside an optimizer state (any nesting: a chain, a
    named chain, NNX's optimizer state), or None.

    Raises:
      ValueError: several of them (the FP8 state can follow one accumulation only);
        `owner` names the caller in the message.
    """
    is_ms = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_ms) if is_ms(x)]
    if len(found) > 1:
        raise ValueError(f"{owner}: the optimizer holds {len(found)} optax.MultiSteps; the "
                         "FP8 state can follow one accumulation only (wrap the whole "
                         "optimizer in one MultiSteps)")
    return found[0] if found else None


def gradient_step(opt_state, owner: str) -> jax.Array:
    """The accumulation's count of applied steps (`find`'s ``gradient_step``)."""
    found = find(opt_state, owner)
    if found is None:
        raise ValueError(f"{owner}: the optimizer state holds no optax.MultiSteps, but the FP8 "
                         "state keeps pending amaxes for one (build it with the optimizer "
                         "it is used with)")
    step = found.gradient_step
    return step[...] if hasattr(step, "get_value") else step


def _amax_slots(states) -> Any:
    """A float32 array of each state's scale shape (where its amax goes), in its place."""
    return jax.tree.map(lambda s: s.scale if state_lib.is_state(s) else s, states,
                        is_leaf=state_lib.is_state)


def zero_pending(states, opt_state, owner: str) -> list | None:
    """Zero pending amaxes for the delayed-scaling states of `states` when `opt_state`
    accumulates (`find`), else None (no accumulation, or nothing to update)."""
    if not state_lib.states_info(states) or find(opt_state, owner) is None:
        return None
    return [jnp.zeros_like(a) for a in jax.tree.leaves(_amax_slots(states))]


def accumulate(states, fp8_grads, pending: list, applied, recipe,
               axis_name=None) -> tuple[Any, list]:
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
