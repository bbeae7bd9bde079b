"""`Fp8State`: the FP8 state of one Equinox layer, a pytree node optimizers cannot take.

An Equinox model is one pytree: ``eqx.filter_value_and_grad`` differentiates every float
array in it, the FP8 states included (their gradients carry the observed amaxes, see
`jax_fp8.meta`). Those must reach the fused update, never an optimizer. An `Fp8State`
refuses to be flattened by optax (``optim.init`` / ``optim.update`` /
``optax.apply_updates`` given it, or its gradient) and by ``eqx.apply_updates``, with an
error naming the Equinox loop that works; `jax_fp8.equinox.params` puts an
`Fp8Placeholder` where each state stands, which optax carries through untouched and
``eqx.apply_updates`` refuses in turn (it would leave the FP8 state without its update).
"""

from __future__ import annotations

import dataclasses
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import jax

from jax_fp8 import _hints, state as state_lib
from jax_fp8.meta import Fp8Meta
from jax_fp8.recipe import check_recipe, default as default_recipe

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = ["EQUINOX", "FIX", "Fp8Placeholder", "Fp8State", "is_fp8_node"]

# How Equinox spells each fix of the training step's errors (jax_fp8._hints); its modules
# and Equinox's own are named so that an error raised deeper finds it.
EQUINOX = _hints.StepHints(
    framework="Equinox",
    differentiate=("`loss, grads = eqx.filter_value_and_grad(loss_fn)(model, ...)`, whose "
                   "default filter (eqx.is_inexact_array) differentiates the FP8 states too"),
    update=("`model = jax_fp8.equinox.apply_updates(model, updates, grads)` with that whole "
            "gradient tree (not `jax_fp8.equinox.params(grads)`)"),
    optimizer=("`opt_state = optim.init(jax_fp8.equinox.params(model))` and `updates, "
               "opt_state = optim.update(jax_fp8.equinox.params(grads), opt_state, "
               "jax_fp8.equinox.params(model))`"),
    recipe=("each `jax_fp8.equinox.Fp8State` is updated with the recipe it carries, so make "
            "it with its meta from that recipe: `Fp8State.create(recipe)`, as "
            "`jax_fp8.equinox.Fp8Linear(..., recipe=recipe)` and "
            "`jax_fp8.equinox.fp8_model(model, jax_fp8.Fp8Rule(recipe=recipe))` do (not "
            "`Fp8State(meta, recipe)` with a meta of another recipe)"),
    param_grads="`jax_fp8.equinox.params(grads)`",
    multi_steps=("Accumulate the microbatches' gradient trees with "
                 "`jax_fp8.equinox.accumulate_grads` (their amaxes combined by max) and call "
                 "`jax_fp8.equinox.apply_updates` once per optimizer step, with an optimizer "
                 "not wrapped in optax.MultiSteps."),
)
_hints.register(("equinox", "jax_fp8.equinox"), EQUINOX)

FIX = ("The Equinox loop: " + EQUINOX.optimizer + "; in the step " + EQUINOX.loop + " (the "
       "optimizer's updates for the parameters, ONE fused FP8 update for the FP8 states from "
       "the whole gradient tree).")

_OPTAX = ("optax was given jax_fp8.equinox FP8 states, or their gradients (the amaxes a step "
          "observed), e.g. `optim.init(eqx.filter(model, eqx.is_inexact_array))` or "
          "`optim.update(grads, ...)` / `optax.apply_updates(model, ...)` over a model with "
          "FP8 layers: the optimizer would add its updates to the amax histories and "
          "scales, and the FP8 update would never run. " + FIX)
_EQX_UPDATE = ("eqx.apply_updates was given a model with jax_fp8.equinox FP8 states: it "
               "would leave them as they are (the optimizer's updates hold none for them), "
               "and the scales would never change. " + FIX)


def _caller() -> str:
    """The module of the first caller above the flatten that is not JAX (nor jax_fp8)."""
    frame: FrameType | None
    try:
        frame = sys._getframe(3)
    except ValueError:  # pragma: no cover - flattened from the top level
        return ""
    for _ in range(12):
        if frame is None:
            return ""
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("jax"):
            return cast(str, module)
        frame = frame.f_back
    return ""


@dataclasses.dataclass(frozen=True)
class Fp8State:
    """The FP8 state of one layer's GEMM: its `Fp8Meta` and (static) its recipe.

    A pytree node whose one child is ``meta`` (three `ScalingState`s for delayed scaling,
    none for the current and blockwise recipes); in a gradient tree, the same node holds
    the gradient of the meta. Optax and ``eqx.apply_updates`` refuse it (module
    docstring).
    """

    meta: Fp8Meta
    recipe: Any = default_recipe()

    @classmethod
    def create(cls, recipe: Any = None, shape: Sequence[int] = ()) -> Fp8State:
        """A fresh state for ``recipe`` (default ``DelayedScaling()``); ``shape``: the
        leading axes of stacked layers."""
        recipe = default_recipe() if recipe is None else recipe
        check_recipe(recipe, "recipe")
        return cls(Fp8Meta.create(recipe, shape), recipe)


def _refuse_optimizers() -> None:
    caller = _caller()
    if state_lib.is_optax(caller):
        raise ValueError(_OPTAX)
    if caller == "equinox._update":
        raise ValueError(_EQX_UPDATE)


def _flatten_with_keys(state: Fp8State
                       ) -> tuple[tuple[tuple[jax.tree_util.GetAttrKey, Fp8Meta]], Any]:
    _refuse_optimizers()
    return ((jax.tree_util.GetAttrKey("meta"), state.meta),), state.recipe


def _flatten(state: Fp8State) -> tuple[tuple[Fp8Meta], Any]:
    _refuse_optimizers()
    return (state.meta,), state.recipe


def _unflatten(recipe: Any, children: Iterable[Any]) -> Fp8State:
    (meta,) = children
    return Fp8State(meta, recipe)


jax.tree_util.register_pytree_with_keys(Fp8State, _flatten_with_keys, _unflatten,
                                        flatten_func=_flatten)


class Fp8Placeholder:
    """Where an `Fp8State` stands in the tree `jax_fp8.equinox.params` returns: a pytree
    node without leaves, which optax keeps as it is and ``eqx.apply_updates`` refuses."""

    def __repr__(self) -> str:
        return "Fp8Placeholder()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fp8Placeholder)

    def __hash__(self) -> int:
        return hash(Fp8Placeholder)


def _flatten_placeholder(node: Fp8Placeholder) -> tuple[tuple[()], None]:
    if _caller() == "equinox._update":
        raise ValueError(_EQX_UPDATE)
    return (), None


jax.tree_util.register_pytree_node(Fp8Placeholder, _flatten_placeholder,
                                   lambda aux, children: Fp8Placeholder())


def is_fp8_node(x: Any) -> bool:
    """An `Fp8State` or an `Fp8Placeholder` (the ``is_leaf`` of the helpers here)."""
    return isinstance(x, (Fp8State, Fp8Placeholder))
