"""The texts of the FP8 errors that differ by framework: `StepHints`, plain JAX's, and the
adapter whose code is running.

An error about the FP8 state names the fix in the caller's own spelling. The training step
(`jax_fp8._training_step`) is given its caller's hints; each adapter (linen, NNX, Equinox)
fills in one `StepHints` and `register`s the modules that are its own, so that an error
raised deeper (a GEMM's trace-time check, an optax flatten, an FP8 gradient rebuilt by
tree code) finds them on the call stack (`of_caller`); plain JAX, the fallback, names
only jax_fp8's core functions.
"""

from __future__ import annotations

import dataclasses
import sys
from types import FrameType

__all__ = ["PLAIN", "StepHints", "imported", "of_caller", "register"]


@dataclasses.dataclass(frozen=True)
class StepHints:
    """How one framework spells each fix, as whole phrases a message can quote.

    Attributes:
      framework: the name a message gives the framework ("linen", "NNX", "Equinox";
        "plain JAX").
      differentiate: how to get the FP8 gradients with the parameters' gradients.
      update: how to hand them to the FP8 update, with the layers' recipe.
      optimizer: how to keep the FP8 state out of the optimizer.
      recipe: how to give the update the recipe the layers were made with, or make the
        layers with the update's.
      param_grads: the parameter gradients, the part a gradient transform may change.
      multi_steps: under ``optax.MultiSteps``, how to keep the pending amaxes where this
        step cannot ("" where it keeps them itself).
      reuse: what in this framework applies one FP8 state twice, and how not to ("").
      scan: how this framework's scan carries an FP8 state per iteration ("").
      call: the function the user called, which an error names first ("": none; an
        adapter sets it per call, `at`).
    """

    framework: str
    differentiate: str
    update: str
    optimizer: str
    recipe: str
    param_grads: str
    multi_steps: str = ""
    reuse: str = ""
    scan: str = ""
    call: str = ""

    def at(self, call: str) -> StepHints:
        """These hints for an error of ``call``."""
        return dataclasses.replace(self, call=call)

    @property
    def loop(self) -> str:
        """The loop that updates the FP8 state: the FP8 gradients, then the update."""
        return f"{self.differentiate}, then {self.update}"


PLAIN = StepHints(
    framework="Plain JAX",
    differentiate=("`loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))("
                   "params, fp8)` (the FP8 state an argument of its own)"),
    update=("`fp8 = jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)`, with `recipe` the one the "
            "states were made with"),
    optimizer=("give the optimizer the parameters only (`optim.init(params)`, "
               "`optim.update(grads, opt_state, params)`) and update the FP8 state with "
               "`jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)`"),
    recipe=("pass the recipe the states were made with to the update "
            "(`jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)`), or make the states with the "
            "update's recipe (`jax_fp8.Fp8Meta.create(recipe)`)"),
    param_grads="the parameter gradients (`grads`, not `fp8_grads`)",
)

# (module names, hints) of each adapter imported: a module is an adapter's when its name
# is one of them or starts with one followed by a dot.
_ADAPTERS: list[tuple[tuple[str, ...], StepHints]] = []


def register(modules: tuple[str, ...], hints: StepHints) -> None:
    """Names ``modules`` (and their submodules) as those of the adapter ``hints`` speak for."""
    _ADAPTERS.append((modules, hints))


def _adapter_of(module: str) -> StepHints | None:
    for modules, hints in _ADAPTERS:
        if any(module == m or module.startswith(m + ".") for m in modules):
            return hints
    return None


def _on_stack() -> StepHints | None:
    """The hints of the adapter whose code is innermost on the call stack, else None."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        found = _adapter_of(frame.f_globals.get("__name__", ""))
        if found is not None:
            return found
        frame = frame.f_back
    return None


def of_caller() -> StepHints:
    """The hints of the adapter whose code is innermost on the call stack (a layer being
    traced, an adapter's step, the framework's own module code), else `PLAIN`. For error
    paths only: it reads every frame."""
    return _on_stack() or PLAIN


def imported() -> list[StepHints]:
    """For an error whose caller may be any framework's (optax or jax.export called from the
    user's own code): the adapter on the call stack, else plain JAX's hints and those of
    every adapter imported."""
    found = _on_stack()
    return [found] if found is not None else [PLAIN, *(hints for _, hints in _ADAPTERS)]
