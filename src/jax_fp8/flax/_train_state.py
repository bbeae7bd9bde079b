"""`Fp8TrainState`: Flax's ``TrainState`` plus the FP8 state, kept away from the optimizer.

Also `fp8_value_and_grad` (the gradient w.r.t. the parameters and the FP8 state, the
latter as FP8 gradients) and `split_fp8`. The layers whose state it holds are
`jax_fp8.flax.linen`'s; every name here is importable from there and from
`jax_fp8.flax`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

import jax_fp8.recipes  # noqa: F401  (registers the recipes whose default() is asked below)
from jax_fp8 import _fp8_grads, _hints, _training_step, recipe as recipe_lib, state as state_lib
from jax_fp8._training_step import Fp8Part
from jax_fp8.flax._linen_variables import FP8_COLLECTION
from jax_fp8.packing import PackedStates, pack_states, unpack_states
from jax_fp8.recipe import Recipe, default as default_recipe

# How linen spells each fix of the training step's errors (jax_fp8._hints); its modules and
# Flax's linen ones are named so that an error raised deeper finds it.
LINEN = _hints.StepHints(
    framework="linen",
    differentiate=("`loss, grads = state.value_and_grad(loss_fn)(...)` with a "
                   "`jax_fp8.flax.Fp8TrainState` (the gradient w.r.t. the params and the FP8 "
                   "collection; by hand `jax.value_and_grad(loss_fn, argnums=(0, 1))("
                   "state.params, state.fp8)`, its second part passed as `fp8_grads=`)"),
    update=("`state = state.apply_gradients(grads=grads)`, the train state created with "
            "`recipe=` the one the layers were made with"),
    optimizer=("`state = jax_fp8.flax.Fp8TrainState.create(apply_fn=model.apply, "
               "variables=variables, tx=tx, recipe=recipe)` (not flax's "
               "`TrainState.create(params=variables)`), whose optimizer sees "
               "`variables['params']` only; by hand, optax on variables['params'] only and "
               "`jax_fp8.new_fp8_state(fp8, fp8_grads, recipe)` for the FP8 collection"),
    recipe=("pass `recipe=` to `Fp8TrainState.create(..., recipe=recipe)` "
            "(`state.apply_gradients` updates with it), or make the layers with the train "
            "state's recipe (`nn.Dense(..., dot_general_cls=functools.partial(Fp8DotGeneral, "
            "recipe=recipe))`, `jax_fp8.flax.fp8_model(model, jax_fp8.Fp8Rule(recipe=recipe))`)"),
    param_grads="`grads['params']`",
    reuse=(", or call its layers twice inside one apply, where they thread (not "
           "`state.apply_model` / `model.apply` twice)"),
    scan="nn.scan: variable_axes={'fp8_meta': 0}, or variable_carry='fp8_meta'",
)
_hints.register(("flax.linen", "flax.core", "flax.training", "jax_fp8.flax.linen",
                 "jax_fp8.flax.linen_conversion", "jax_fp8.flax._linen_variables",
                 "jax_fp8.flax._train_state"), LINEN)


def split_fp8(variables: Mapping[str, Any], collection: str = FP8_COLLECTION,
              ) -> tuple[dict[str, Any], Any]:
    """``{"params": p, "fp8_meta": f, ...}`` -> (everything but the FP8 collection, f)."""
    variables = dict(variables)
    fp8 = variables.pop(collection, {})
    return variables, fp8


def _is_combined(grads: Any, params: Any, collection: str) -> bool:
    """True for the gradient of `fp8_value_and_grad`: {"params": ..., collection: ...}:
    its parameter part of the structure of ``params``, or its FP8 part FP8 gradients
    (`jax_fp8.AmaxGrad`s; the parameter part then is what the optimizer takes, e.g. the
    gradient of ``optax.LookaheadParams``' fast parameters)."""
    if not (isinstance(grads, Mapping) and set(grads) == {"params", collection}):
        return False
    is_grad: Callable[[Any], bool] = lambda x: isinstance(x, _fp8_grads.AmaxGrad)  # noqa: E731
    return (jax.tree.structure(grads["params"]) == jax.tree.structure(params)  # type: ignore[operator]
            or any(is_grad(x) for x in jax.tree.leaves(grads[collection], is_leaf=is_grad)))


def _check_params_alone(params: Any, recipe: Recipe, collection: str) -> None:
    """ValueError for ``create(params=...)`` without ``fp8=`` (Flax's ``TrainState``
    habit), which would leave the model's FP8 state out of the train state."""
    if isinstance(params, Mapping) and "params" in params and collection in params:
        raise ValueError(
            f"Fp8TrainState.create: params= holds the collections {sorted(params)}, which "
            f"is model.init's whole result: pass it as variables= (params and the FP8 "
            f"state {collection!r} together)")
    if recipe.keeps_state:
        raise ValueError(
            f"Fp8TrainState.create: params= without fp8=. With {type(recipe).__name__} the "
            f"model's FP8 layers keep state (model.init's {collection!r} collection); without "
            f"it in the train state, evaluation would run on fresh FP8 states and no step "
            f"would update them. Pass variables=model.init(...) (params and FP8 state "
            f"together), or params=variables['params'], fp8=variables[{collection!r}] "
            f"(fp8={{}} for a model without FP8 layers)")


# flax.struct's dataclass machinery (__init_subclass__, struct.field, TrainState.create and
# apply_gradients) is unannotated.
class Fp8TrainState(train_state.TrainState):  # type: ignore[no-untyped-call]
    """``flax.training.train_state.TrainState`` plus the FP8 state, outside the optimizer.

    ``params`` and ``opt_state`` are exactly those of a plain TrainState (the FP8
    collection never reaches optax: no Adam moments, clipping or weight decay for it).
    ``fp8`` holds the FP8 collection; `apply_gradients` replaces it with one fused
    ``update_states`` call driven by the FP8 gradients. Under ``optax.MultiSteps``,
    ``fp8_pending`` holds the max of the amaxes seen since the last optimizer step (a
    list of float32 arrays, one per state of ``fp8`` in tree order); else None.
    """

    fp8: Any = None
    # {FP8 dtype name: number of states}: in the tree (and so in every checkpoint), so a
    # restore into a state of another FP8 format fails on the keys instead of relabelling.
    fp8_formats: Any = None
    fp8_pending: Any = None
    recipe: Recipe = struct.field(  # type: ignore[no-untyped-call]
        pytree_node=False, default=default_recipe())
    fp8_collection: str = struct.field(pytree_node=False, default=FP8_COLLECTION)  # type: ignore[no-untyped-call]
    # The texts of its errors, and of jax_fp8.check_fp8_updated(state).
    fp8_hints = LINEN

    @classmethod
    def create(cls, *, apply_fn: Callable[..., Any], tx: Any, variables: Any = None,
               params: Any = None, fp8: Any = None, recipe: recipe_lib.Recipe | None = None,
               fp8_collection: str = FP8_COLLECTION, pack_fp8: bool = True,
               **kwargs: Any) -> Fp8TrainState:
        """From ``variables`` (as returned by ``model.init``), or ``params`` and ``fp8``.

        Args:
          apply_fn: the model's ``apply``.
          tx: the optax transformation of the parameters (it never sees the FP8 state).
          variables: ``model.init``'s result: ``"params"`` and the FP8 collection only,
            else ValueError (pass ``params=`` and ``fp8=`` and keep other collections
            yourself).
          params: the parameters, in place of ``variables``.
          fp8: the FP8 collection, with ``params``: ``variables["fp8_meta"]`` of
            ``model.init``. Required with ``params`` when ``recipe`` keeps state (delayed
            scaling), else ValueError: without it the layers would run on fresh FP8
            states that no step updates; ``fp8={}`` for a model without FP8 layers.
          recipe: the recipe the FP8 states were made by (default ``DelayedScaling()``):
            every FP8 state must follow it (history length and FP8 dtypes; the layers'
            ``recipe`` attribute), else ValueError. A current or blockwise recipe keeps
            no state: the FP8 collection must then be empty.
          fp8_collection: the name of the FP8 collection (the layers' ``collection``).
          pack_fp8: keep the FP8 collection packed into one stacked state per (FP8
            dtype, history length) (`jax_fp8.pack_states`, the default): the step then
            takes 3 arrays per group instead of 3 per FP8 tensor, which cuts JAX's
            per-argument host cost, the fused update runs on stacked states, and a
            checkpoint records each group's FP8 dtype. The layers still see their own
            states. False keeps the collection as the model made it.
          **kwargs: other fields of Flax's ``TrainState``.

        With ``tx`` an ``optax.MultiSteps`` (alone or inside a chain), the FP8 state is
        updated once per optimizer step from the max of its microbatches' amaxes.
        """
        if variables is not None:
            if params is not None or fp8 is not None:
                raise ValueError("pass either variables, or params (and fp8), not both")
            rest, fp8 = split_fp8(variables, fp8_collection)
            if set(rest) != {"params"}:
                raise ValueError(f"variables has collections {sorted(rest)}; expected only "
                                 f"'params' and {fp8_collection!r}. Pass params= and fp8= "
                                 "and keep the other collections yourself")
            params = rest["params"]
        recipe = recipe_lib.default() if recipe is None else recipe
        recipe_lib.check_recipe(recipe, "recipe")
        if params is not None and fp8 is None:
            _check_params_alone(params, recipe, fp8_collection)
        fp8 = {} if fp8 is None else fp8
        state_lib.check_states_follow(recipe, fp8, "fp8", LINEN.at("Fp8TrainState.create"))
        counts: dict[str, int] = {}
        for _, dtype, _ in state_lib.states_info(fp8):
            counts[dtype.name] = counts.get(dtype.name, 0) + 1
        formats = {name: jnp.int32(n) for name, n in sorted(counts.items())}
        if pack_fp8 and not isinstance(fp8, PackedStates):
            fp8 = pack_states(fp8)
        new: Fp8TrainState = super().create(  # type: ignore[no-untyped-call]
            apply_fn=apply_fn, params=params, tx=tx, fp8=fp8, fp8_formats=formats,
            recipe=recipe, fp8_collection=fp8_collection, **kwargs)
        if counts:
            new = new.replace(fp8_pending=_training_step.zero_pending(fp8, new.opt_state,
                                                                      "Fp8TrainState"))
        return new

    def variables(self, params: Any = None, fp8: Any = None) -> dict[str, Any]:
        """The model's variables; a packed FP8 state is handed to the layers unpacked."""
        fp8 = self.fp8 if fp8 is None else fp8
        return {"params": self.params if params is None else params,
                self.fp8_collection: unpack_states(fp8)}

    def apply_model(self, params: Any, fp8: Any, *args: Any,
                    mutable: str | Sequence[str] = (), **kwargs: Any) -> Any:
        """``apply_fn`` with the FP8 collection mutable (so reused modules thread their state).

        For training (inside the loss) and evaluation alike:
        ``state.apply_model(state.params, state.fp8, x)``. Returns the output; with extra
        ``mutable`` collections, (output, their updates).
        """
        extra = [mutable] if isinstance(mutable, str) else list(mutable)
        given = self.fp8 if fp8 is None else fp8
        out, updates = self.apply_fn(self.variables(params, fp8), *args,
                                     mutable=[self.fp8_collection, *extra], **kwargs)
        if not state_lib.states_info(given):
            made = state_lib.states_info(dict(updates).get(self.fp8_collection, {}))
            if made:
                raise ValueError(
                    f"Fp8TrainState.apply_model: the model's FP8 layers made {len(made)} "
                    f"fresh FP8 states because the train state holds none: it was created "
                    f"without the model's {self.fp8_collection!r} collection. Create it with "
                    f"variables=model.init(...), or params= and fp8=variables"
                    f"[{self.fp8_collection!r}]")
        if extra:
            updates = dict(updates)
            updates.pop(self.fp8_collection, None)
            return out, updates
        return out

    def value_and_grad(self, loss_fn: Callable[..., Any], has_aux: bool = False,
                       ) -> Callable[..., tuple[Any, dict[str, Any]]]:
        """``loss_fn(params, fp8, *args)`` -> f(*args) = ``(loss[, aux]), grads``.

        The gradient is w.r.t. ``self.params`` and ``self.fp8``: ``grads`` is
        ``{"params": ..., fp8_collection: ...}``, what `apply_gradients` takes as
        ``grads=``. Inside ``loss_fn`` apply the model with
        ``self.apply_model(params, fp8, ...)``.
        """
        vg = fp8_value_and_grad(loss_fn, has_aux, collection=self.fp8_collection)
        return functools.partial(vg, self.params, self.fp8)

    def apply_gradients(self, *, grads: Any, fp8_grads: Any = None,
                        axis_name: Any = None, **kwargs: Any) -> Fp8TrainState:
        """The optimizer step on ``params``, and the FP8 state from ONE ``update_states``.

        Args:
          grads: ``{"params": ..., fp8_collection: ...}`` as `value_and_grad` returns
            them, or the gradient w.r.t. ``params`` alone with ``fp8_grads``.
          fp8_grads: the gradient w.r.t. ``fp8`` (same structure as ``self.fp8``).
          axis_name: inside ``jax.pmap`` (or ``shard_map``), the mapped axis (or axes)
            whose devices' amaxes the update max-reduces first (one ``pmax``), so every
            replica of the FP8 state gets the same update. Required under ``pmap``.

        Raises:
          ValueError: in the order of every adapter's step (`jax_fp8._training_step`):
            a state of ``fp8`` does not follow ``recipe``; the state holds delayed-scaling
            states and no FP8 gradient was given (their scales would never change), unless
            inside `jax_fp8.frozen_scales`, where the FP8 state is kept as it is; or traced
            inside ``jax.pmap`` without ``axis_name``. Each before anything changes.

        Under ``optax.MultiSteps`` the FP8 gradients' amaxes are combined by max into
        ``fp8_pending`` and the FP8 state is updated only when the optimizer applies.
        """
        if _is_combined(grads, self.params, self.fp8_collection):
            if fp8_grads is not None:
                raise ValueError("Fp8TrainState.apply_gradients: grads already holds the FP8 "
                                 "gradients (as value_and_grad returns them); pass it "
                                 "alone, without fp8_grads")
            grads, fp8_grads = grads["params"], grads[self.fp8_collection]

        def optimizer_step() -> tuple[Any, Any]:
            new = super(Fp8TrainState, self).apply_gradients(grads=grads, **kwargs)  # type: ignore[no-untyped-call]
            return new, new.opt_state

        missing = _training_step.paths(self.fp8) if fp8_grads is None else []
        new, (fp8,), pending = _training_step.step(
            LINEN.at("Fp8TrainState.apply_gradients"),
            [Fp8Part(self.recipe, self.fp8, fp8_grads)], optimizer_step, name="fp8",
            missing=missing, opt_state=self.opt_state, pending=self.fp8_pending,
            axis_name=axis_name)
        return cast("Fp8TrainState", new.replace(fp8=fp8, fp8_pending=pending))


def fp8_value_and_grad(loss_fn: Callable[..., Any], has_aux: bool = False,
                       collection: str = FP8_COLLECTION
                       ) -> Callable[..., tuple[Any, dict[str, Any]]]:
    """``loss_fn(params, fp8, *args)`` -> f(params, fp8, *args) = ``(loss[, aux]), grads``.

    ``grads`` is ``{"params": <gradient w.r.t. params>, collection: <FP8 gradients>}``,
    what `Fp8TrainState.apply_gradients` takes as ``grads=`` (`Fp8TrainState.value_and_grad`
    binds ``params`` and ``fp8`` to the state's). The FP8 gradients are `jax_fp8.AmaxGrad`s
    (the structure of ``fp8``): they refuse arithmetic, so a transform written over all of
    ``grads`` (a loss scale, a clip, a sum) raises at trace time instead of changing the
    amaxes; apply such transforms to ``grads["params"]``. NNX's
    `jax_fp8.flax.nnx.fp8_value_and_grad` returns the same ``(loss[, aux]), grads``.
    """
    vg = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=has_aux)

    def f(params: Any, fp8: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        value, (grads, fp8_grads) = vg(params, fp8, *args, **kwargs)
        return value, {"params": grads,
                       collection: _fp8_grads.fp8_grads_from_cotangents(fp8_grads)}

    return f
