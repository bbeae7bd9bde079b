"""Flax NNX FP8 layers and the variables that hold their FP8 state.

`Fp8State` (an ``nnx.Variable`` subtype) holds one FP8 tensor's `ScalingState`; the
layers (`Fp8DotGeneral`, `Fp8Einsum`, `Fp8RaggedDot`, `Fp8Linear`) read it, run the FP8
GEMM and write back the meta it returned, so several calls per step thread the state.
`Fp8Grad` is what the gradient holds for an `Fp8State`. Part of `jax_fp8.flax.nnx`,
which re-exports every public name.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_fp8 import _trace_checks, interception, recipe as recipe_lib
from jax_fp8.gemm.dot_general import check_min_fp8_flops, fp8_dot_general
from jax_fp8.gemm.einsum import fp8_einsum
from jax_fp8.gemm.ragged_fp8 import fp8_ragged_dot
from jax_fp8.meta import Fp8Meta


class Fp8State(nnx.Variable):  # type: ignore[type-arg]  # a subscripted base: another class
    """The delayed-scaling state (a `ScalingState`) of one FP8 tensor."""


class Fp8Grad(nnx.Param):  # type: ignore[type-arg]  # a subscripted base: another class
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


def _get(var: nnx.Variable[Any]) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


def _set(var: nnx.Variable[Any], value: Any) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:
        var.value = value


class _Fp8Base(nnx.Module):
    def __init__(self, recipe: recipe_lib.Recipe | None = None, *unexpected: Any,
                 min_fp8_flops: float | str = 0, **unexpected_kw: Any) -> None:
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

    def _report(self, kind: str, lhs: jax.Array, rhs: jax.Array,
                dimension_numbers: Any) -> None:
        # The FP8 layer fp8_model gave a module: reported (Fp8ConversionWarning) when it
        # keeps a GEMM below min_fp8_flops. Its report: (path, module type, rule), static.
        report = getattr(self, "_fp8_report", None)
        if report is not None and self.min_fp8_flops:
            path, module_type, rule = report
            interception.note_gemm(interception.Site(rule, None, path=path,
                                                     module_type=module_type),
                                   kind, lhs, rhs, dimension_numbers)

    @property
    def meta(self) -> Fp8Meta:
        if self.stateless_recipe is not None:
            return Fp8Meta(recipe=self.stateless_recipe)
        return Fp8Meta(*(_get(getattr(self, n)) for n in Fp8Meta.STATES))

    def _thread(self, meta: Fp8Meta) -> None:
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
        self._report("dot_general", lhs, rhs, dimension_numbers)
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
            self._report("einsum", lhs, rhs, interception.einsum_dimension_numbers(explicit))
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

    def __init__(self, recipe: recipe_lib.Recipe | None = None, *unexpected: Any,
                 num_groups: int, min_fp8_flops: float | str = 0,
                 **unexpected_kw: Any) -> None:
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

    def __init__(self, in_features: int, out_features: int, *,
                 recipe: recipe_lib.Recipe | None = None, min_fp8_flops: float | str = 0,
                 rngs: nnx.Rngs, **kwargs: Any) -> None:
        if "dot_general" in kwargs:
            raise TypeError("Fp8Linear sets dot_general itself")
        super().__init__(in_features, out_features, rngs=rngs,
                         dot_general=Fp8DotGeneral(recipe, min_fp8_flops=min_fp8_flops),
                         **kwargs)
