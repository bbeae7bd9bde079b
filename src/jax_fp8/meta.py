"""Fp8Meta (the FP8 state of one GEMM) and how observed amaxes leave a train step.

`fp8_dot_general` never updates state. It quantizes with the *current* scales (delayed
scaling) and reports what it observed -- the amax of its input, of its kernel and, in the
backward pass, of the incoming gradient -- as the **cotangent of its `Fp8Meta` argument**:
each state's cotangent is an *amax record* (`jax_fp8._fp8_grads.amax_record`): the
"gradient" w.r.t. its ``amax_history`` is zero except in the staging slot ``[..., 0]``,
which holds the observed amax, and those w.r.t. ``scale`` and ``scale_inv`` hold the
amax's low-order part and a unit, so that the amax reads back exactly after any uniform
rescale of the gradient tree (a loss scale undone) or a mean over devices (the backward
max-reduces the amaxes over ``pmap``'s axes first, so every device's record is the same).
`new_fp8_state(meta, meta_grads, recipe)` then reads the records and updates the whole
model's FP8 state with ONE `update_states` call.

Amaxes combine by max, never by sum (``docs/semantics.md``, "Several uses of one state"):

* the op is *threaded*: ``out, meta = fp8_dot_general(x, w, dn, meta)``; the backward of
  each use emits ``fmax(cotangent of the meta it returned, its own amax)``, so a chain
  ``meta0 -> use 1 -> meta1 -> use 2`` reports ``max(amax_1, amax_2)``. The Flax layers
  thread for you. Passing one meta value to two uses is an error at trace time;
* under ``jax.vmap`` with one shared (unbatched) meta, the amax is the max over the batch;
* microbatches: combine their FP8 gradients with `combine_fp8_grads` (max), not ``+``.

A delayed-scaling GEMM differentiated w.r.t. its operands but not its meta would drop the
amaxes, and its scales would never change: that is an error at trace time
(`jax_fp8._trace_checks.claim`), unless the scales are frozen on purpose (`frozen_scales`).

This module holds `Fp8Meta` and the update of the FP8 state from the amaxes
(`new_fp8_state`, `check_fp8_updated`); the FP8 gradients that carry the amaxes are
`jax_fp8._fp8_grads` (`AmaxGrad`), the trace-time checks `jax_fp8._trace_checks`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.export  # noqa: F401  (register_pytree_node_serialization)
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike

from jax_fp8 import _hints, recipe as recipe_lib, state as state_lib
from jax_fp8._fp8_grads import (
    AmaxGrad,
    amax_cotangents,
    amax_record,
    combine_fp8_grads,
    fp8_grads_from_cotangents,
    recorded_amax,
)
from jax_fp8._primitives import amax as amax_lib
from jax_fp8._trace_checks import frozen_scales, scales_frozen
from jax_fp8.state import ScalingState, is_state
from jax_fp8.update import update_states

__all__ = ["AmaxGrad", "Fp8Meta", "amax_cotangents", "check_fp8_updated", "combine_fp8_grads",
           "fp8_grads_from_cotangents", "frozen_scales", "new_fp8_state", "scales_frozen"]


@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """What one GEMM needs to run in FP8: its recipe, and for delayed scaling its states.

    Delayed scaling (``recipe=None``): a registered pytree of three `ScalingState`s, for
    its input (lhs), its kernel (rhs) and its output gradient; the input and kernel use
    ``fp8_format.fwd_dtype`` and the gradient ``fp8_format.bwd_dtype`` (E5M2 under
    HYBRID). Current and blockwise scaling keep no state: ``input``, ``kernel`` and
    ``grad`` are None and the (static) ``recipe`` says how to scale. The functional call
    is the same for all three recipes.

    Example:

        meta = Fp8Meta.create(DelayedScaling(history_len=16))     # or Float8BlockScaling()
        out, meta = fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta)
    """

    input: ScalingState | None = None
    kernel: ScalingState | None = None
    grad: ScalingState | None = None

    # The names of its three states (the FP8 layers' variables are named so).
    STATES = ("input", "kernel", "grad")
    recipe: recipe_lib.Recipe | None = None

    @classmethod
    def create(cls, recipe: recipe_lib.Recipe | None = None, shape: Sequence[int] = (),
               history_len: int | None = None) -> Fp8Meta:
        """Fresh states for one GEMM (``shape``: leading axes, e.g. stacked layers), or the
        stateless meta of a current/blockwise recipe."""
        recipe = recipe_lib.default() if recipe is None else recipe
        meta: Fp8Meta = recipe_lib.check_recipe(recipe, "recipe").create_meta(shape, history_len)
        return meta

    @property
    def stateless(self) -> bool:
        """True for a recipe that keeps no state (current, blockwise, MXFP8)."""
        return self.recipe is not None

    def replace(self, **changes: Any) -> Fp8Meta:
        """A copy with the given fields replaced (as ``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(Fp8Meta, data_fields=["input", "kernel", "grad"],
                                 meta_fields=["recipe"])


def _serialize_aux(aux: tuple[Any]) -> bytes:
    """A meta's recipe as stored: ``null`` for a meta of states, else a JSON object of the
    recipe's registered name (key ``recipe``) then its `Recipe.to_fields`."""
    (recipe,) = aux
    if recipe is None:
        return b"null"
    fields = recipe.to_fields()
    if "recipe" in fields:
        raise ValueError(f"{type(recipe).__name__}.to_fields() has a field 'recipe', the key "
                         f"of the recipe's name in a serialized Fp8Meta")
    return json.dumps({"recipe": type(recipe).__name__, **fields}).encode()


def _deserialize_aux(data: bytes) -> tuple[recipe_lib.Recipe | None]:
    fields = json.loads(data.decode())
    if fields is None:
        return (None,)
    return (recipe_lib.by_name(fields.pop("recipe")).from_fields(fields),)


jax.export.register_pytree_node_serialization(
    Fp8Meta, serialized_name="jax_fp8.Fp8Meta", serialize_auxdata=_serialize_aux,
    deserialize_auxdata=_deserialize_aux)


def amax_cotangent(ct: ScalingState, amax: ArrayLike, primal: ScalingState,
                   reduce: Any = None) -> ScalingState:
    """The cotangent one use hands back: the amax record (`jax_fp8._fp8_grads.amax_record`)
    of fmax(downstream uses' amax, this use's amax), reduced first by ``reduce(amax,
    primal)`` where given (inside shard_map, the max over the devices the state does not
    vary over: the record's parts are all made from the reduced amax).

    Where nothing downstream used the threaded meta (a symbolic zero cotangent), the
    staging slot is this use's amax itself: fmax(0, amax) would change nothing that the
    update's own fmaxf(h[0], amax) does not already do, and skipping it spares the step
    one scalar kernel per state. The amax is then given the batching of ``primal``
    (`amax_lib.amax_for_state`): under ``vmap`` with one shared state the batch's amaxes
    are reduced by max here, before JAX would sum them.
    """
    amax = jnp.asarray(amax, jnp.float32)
    if isinstance(ct.amax_history, SymbolicZero):
        staged = amax
    else:
        def value(x: Any, like: jax.Array) -> Any:
            return jnp.zeros_like(like) if isinstance(x, SymbolicZero) else x
        downstream = ScalingState(ct.amax_history, value(ct.scale, primal.scale),
                                  value(ct.scale_inv, primal.scale_inv),
                                  fp8_dtype=primal.fp8_dtype)
        staged = jnp.fmax(recorded_amax(downstream), amax)
    staged = amax_lib.amax_for_state(staged, primal.scale)
    if reduce is not None:
        staged = reduce(staged, primal)
    return amax_record(staged, primal)


def new_fp8_state(fp8_states: Any, fp8_grads: Any, recipe: recipe_lib.Recipe | None = None, *,
                  axis_name: Hashable | None = None, implementation: str = "auto") -> Any:
    """The step's new FP8 state: ONE `update_states` call for every state of the model.

    Args:
      fp8_states: any pytree of ScalingStates (e.g. Fp8Metas, a Flax collection, a
        `PackedStates`).
      fp8_grads: the FP8 gradients of ``fp8_states`` (same structure): an `AmaxGrad`
        per state as jax_fp8's value_and_grad functions return them, or JAX's raw
        cotangent (a ScalingState whose staging slot ``amax_history[..., 0]`` holds the
        amax observed this step), which must arrive unchanged.
      recipe: the recipe the states were made by (default ``DelayedScaling()``); every
        state's history length and FP8 dtype must be the ones it gives them, else
        ValueError (checked at trace time). A current or blockwise recipe keeps no state:
        ``fp8_states`` must then hold none, and is returned as is.
      axis_name: inside ``shard_map`` / ``pmap``, the axis (or axes) whose devices'
        amaxes are combined, with one ``pmax`` for all of them (see ``update_states``).

    Returns:
      ``fp8_states`` updated (same structure); traced inside `frozen_scales`,
      ``fp8_states`` as they are (the recipe is still checked).
    """
    recipe = recipe_lib.default() if recipe is None else recipe
    state_lib.check_states_follow(recipe, fp8_states, "fp8_states")
    if not recipe.keeps_state or scales_frozen():
        return fp8_states
    return update_states(fp8_states, amax_cotangents(fp8_grads), recipe=recipe,
                         axis_name=axis_name, implementation=implementation)


def check_fp8_updated(fp8_states: Any, name: str = "fp8_states", *,
                      hints: _hints.StepHints | None = None) -> None:
    """Raises ValueError when the delayed-scaling states in ``fp8_states`` show a training
    loop that does not update them through the FP8 update:

    * every one is still as created (an all-zero amax history and scale 1): the loop
      never passes the FP8 gradients to the update, and trains with unit scales;
    * one holds a negative amax in its history, which no update writes: something else
      changed it, typically an optimizer that was given the FP8 state as parameters and
      applied its gradients (the observed amaxes) as updates.

    Call it on concrete values (outside ``jit``) after a few training steps.
    ``fp8_states``: any pytree of ScalingStates (an Fp8TrainState or its ``fp8``, a
    `PackedStates`, a Flax collection, a whole Flax ``variables`` dict; NNX:
    `jax_fp8.flax.nnx.check_fp8_updated`; Equinox: `jax_fp8.equinox.check_fp8_updated`).
    The message names the fix in ``hints``' spelling (the adapters pass theirs); by
    default that of the tree (an Fp8TrainState's ``fp8_hints``), else of the adapter on
    the call stack, else plain JAX's and those of the adapters imported.
    """
    given = hints or getattr(fp8_states, "fp8_hints", None)
    # A tree from any framework's loop: plain JAX's fix and those of the adapters imported.
    fixes = [given] if given is not None else _hints.imported()
    optimizer = "; ".join(f"{h.framework}: {h.optimizer}; {h.loop}" for h in fixes)
    loop = "; ".join(f"{h.framework}: {h.loop}" for h in fixes)
    leaves = jax.tree_util.tree_leaves_with_path(fp8_states, is_leaf=is_state)
    states = [(jax.tree_util.keystr(path), s) for path, s in leaves if is_state(s)]
    negative = [where for where, s in states if np.any(np.asarray(s.amax_history) < 0)]
    if negative:
        shown = ", ".join(negative[:3]) + (f" and {len(negative) - 3} more" if len(negative) > 3
                                           else "")
        raise ValueError(
            f"{name}: delayed-scaling states with negative amaxes in their history ({shown}), "
            "which no FP8 update writes: something other than the FP8 update changed them, "
            "most likely an optimizer given the FP8 state as parameters that applied its "
            "gradients, the observed amaxes, as updates. Keep the FP8 state out of the "
            f"optimizer. {optimizer}.")
    if states and all(not np.any(np.asarray(s.amax_history)) and
                      np.all(np.asarray(s.scale) == 1) for _, s in states):
        raise ValueError(
            f"{name}: none of its {len(state_lib.states_info(fp8_states))} delayed-scaling "
            "states was ever updated (zero amax histories, scale 1): the training loop does "
            "not pass the FP8 gradients to the update, and trains with unit scales, or "
            "every GEMM of these layers ran out of FP8, below its min_fp8_flops (fp8_model's "
            "default min_fp8_flops='auto' keeps GEMMs too small for FP8 to pay; "
            "`jax_fp8.devtools.explain` lists them; Fp8Rule(min_fp8_flops=0) converts "
            f"every GEMM). The loop that updates them: {loop}.")
