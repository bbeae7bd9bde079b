"""`fp8_model`: the GEMMs of an existing linen or NNX model made FP8, the model's code
unchanged (`Fp8Rule` says which)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
from flax import nnx

from jax_fp8.flax import linen_conversion, nnx_conversion
from jax_fp8.flax.rules import AUTO_MIN_FP8_FLOPS, Fp8ConversionWarning, Fp8Rule, as_rules

__all__ = ["AUTO_MIN_FP8_FLOPS", "Fp8ConversionWarning", "Fp8Rule", "fp8_model"]


def fp8_model(model: Any, rules: Fp8Rule | Sequence[Fp8Rule] | None = None, *example_args: Any,
              methods: Sequence[str] = ("__call__",), **example_kwargs: Any) -> Any:
    """The ``model`` (linen or NNX) with its GEMMs in FP8, the model's code unchanged.

    **Linen** (``model`` a ``flax.linen.Module``; returns a converted copy): every
    ``jax.lax.dot_general`` / ``jax.numpy.einsum`` call made while one of the model's
    ``methods`` runs (the model's own and its submodules', under ``nn.scan``,
    ``nn.remat``, ``nn.vmap`` and the like) is handed, when a rule matches the calling
    module and one operand is a parameter, to a `jax_fp8.flax.Fp8DotGeneral` /
    `jax_fp8.flax.Fp8Einsum` created in that module: exactly the module, the variables
    and the numbers of the model written with those layers (``nn.Dense(...,
    dot_general_cls=Fp8DotGeneral)``). This covers ``nn.Dense``, ``nn.DenseGeneral``,
    ``nn.Einsum`` (their kernel is the rhs), ``nn.MultiHeadDotProductAttention``'s
    projections (``DenseGeneral``s) and hand-written modules' ``dot_general`` / ``einsum``
    of an activation and a parameter (the array the module's ``self.param`` returned, or
    made from it by casts, reshapes, transposes, squeezes and sharding constraints,
    `jax_fp8.interception.FOLLOWED`, as T5X's and MaxText's ``DenseGeneral`` write it;
    partitioned parameters under a mesh included; the GEMM's operand quantized as the
    kernel, whichever side it is on). Such a GEMM of the parameter ``w`` gets the state
    of ``w``, the module ``<module>/w_fp8`` (the variables of an ``Fp8Einsum`` /
    ``Fp8DotGeneral`` of that name), whatever GEMMs ran before it; every GEMM of ``w`` in
    a call threads that one state (amaxes by max). The attention scores and weighted
    values (two activations) stay as they are unless a rule says ``activations=True``
    (then ``Fp8Einsum_<i>`` / ``Fp8DotGeneral_<i>``, by call order in the module). A GEMM
    that stays in high precision: ``jnp.matmul`` / ``@`` / ``jnp.dot``, an einsum of
    other than two operands or with a broadcasting ellipsis, a layer given its own
    ``dot_general`` or ``dot_general_cls`` (``nn.Dense``, ``nn.DenseGeneral``) and every
    GEMM inside it, an einsum given its own ``_dot_general``.

    **NNX** (``model`` an ``flax.nnx.Module``; converted in place): every ``nnx.Linear``,
    ``nnx.LinearGeneral`` and ``nnx.Einsum`` whose path (attribute names joined by ``/``,
    e.g. ``"blocks/0/mlp/up"``) a rule matches gets the FP8 GEMM of that rule:
    ``dot_general=jax_fp8.flax.nnx.Fp8DotGeneral(recipe, min_fp8_flops=...)`` (an
    ``einsum_op`` for ``nnx.Einsum``), exactly the layer, the ``Fp8State`` variables and
    the numbers of the model written with ``Fp8Linear``. Layers stacked by ``nnx.vmap``
    (for ``nnx.scan`` over layers) get stacked FP8 states, one per layer. A matched
    module's own ``jnp.einsum`` / ``jax.lax.dot_general`` of one of its ``nnx.Param``s
    (``self.w[...]``) goes through ``w_fp8``, an FP8 module added to it at the first call
    that multiplies ``w``; that call must run outside ``jit`` / ``grad`` / ``scan``: pass
    example inputs, which ``fp8_model`` feeds to the model once. Such calls of a module
    stacked by ``nnx.vmap`` cannot get states: exclude it. Activation GEMMs, and the
    layers and GEMMs that stay as they are, as for linen.

    In both, the first matching rule decides, a rule with ``recipe=None`` keeps its
    layers as they are, and every matched GEMM runs in FP8 unless its rule's
    ``min_fp8_flops`` keeps it (``"auto"``: too small for FP8 to pay). A matched module
    that runs no GEMM in FP8 (below ``min_fp8_flops``, no operand followed to a
    parameter, operands of a dtype the recipe does not take) is reported once as a
    `jax_fp8.Fp8ConversionWarning` naming the module, the rule and why (linen: at the
    first ``apply``; NNX: at the first call); ``jax_fp8.devtools.explain`` gives each
    GEMM's reason.

    Args:
      model: a linen module (unbound), e.g. ``nn.MultiHeadDotProductAttention(4)`` or a
        model class from another package; or an NNX module.
      rules: an `Fp8Rule`, a sequence of them (the first matching rule decides), or None
        (``Fp8Rule()``: every GEMM with a parameter operand, delayed scaling).
      *example_args: NNX only: inputs of ``model(...)``, called once (eagerly) to add the
        FP8 modules of the modules' own GEMMs; none: they are added at the first eager
        call.
      methods: linen only: the methods through which the model is applied
        (``model.apply(..., method=...)``); GEMMs run outside them stay as they are.
      **example_kwargs: NNX only: keyword inputs of that call.

    Returns:
      Linen: a module of a subclass of ``type(model)`` with the same name and fields. Its
      ``init`` adds the FP8 collection (``"fp8_meta"``, delayed scaling) to the
      variables; ``params`` are those of ``model`` (same paths, shapes and initial
      values), so a checkpoint of ``model``'s params loads into it. Train with
      `Fp8TrainState` as a hand-written FP8 model. NNX: ``model`` itself, its
      ``nnx.Param``s unchanged; train it with ``jax_fp8.flax.nnx.fp8_value_and_grad`` and
      ``Fp8Optimizer`` as a hand-written FP8 model.

    Raises:
      TypeError: ``model`` is neither a linen nor an NNX module (an Equinox module: the
        message names `jax_fp8.equinox.fp8_model`), an argument of the other
        kind of model (example inputs for linen, ``methods`` for NNX), or a bad rule; at
        trace time (linen), a GEMM with a parameter operand in a method where Flax allows
        no submodule, or a module holding a submodule named ``<parameter>_fp8`` of its own.
      ValueError: at trace time (NNX), a module's own GEMM with a parameter operand, not
        seen by an eager call, runs inside a transformation.
    """
    if isinstance(model, nnx.Module):
        if tuple(methods) != ("__call__",):
            raise TypeError("fp8_model(methods=...) is for linen models; an NNX model is "
                            "converted in place, every method")
        return nnx_conversion.convert(model, as_rules(rules), *example_args, **example_kwargs)
    if not isinstance(model, nn.Module):
        equinox = sys.modules.get("equinox")
        if equinox is not None and isinstance(model, equinox.Module):
            raise TypeError(f"jax_fp8.flax.fp8_model: model is an Equinox module "
                            f"({type(model).__name__}), not a Flax one: convert it with "
                            f"jax_fp8.equinox.fp8_model(model, rules) (docs/equinox.md)")
        raise TypeError(f"fp8_model(model): model must be a flax.linen or flax.nnx Module, "
                        f"got {type(model).__name__} (an Equinox model: "
                        f"jax_fp8.equinox.fp8_model)")
    if example_args or example_kwargs:
        raise TypeError("fp8_model: example inputs are for NNX models (a linen model gets "
                        "its FP8 modules at init)")
    return linen_conversion.convert(model, as_rules(rules), methods)
