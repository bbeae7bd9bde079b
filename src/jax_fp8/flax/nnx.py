"""Flax NNX: FP8 delayed-scaling dot_general / Linear with the state in an nnx.Variable.

Usage:

    model = MyModel(...)   # built with jax_fp8.flax.nnx.Fp8Linear, or
                           # nnx.Linear(..., dot_general=Fp8DotGeneral(recipe))
    optimizer = Fp8Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param, recipe=recipe)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = fp8_value_and_grad(loss_fn)(model, x, y)   # params and Fp8States
        optimizer.update(model, grads)        # optax + ONE fused FP8 update
        return loss

(or ``apply_gradients(model, optimizer, grads, recipe)`` with a plain ``nnx.Optimizer``).

Every FP8 tensor's state is an `Fp8State` variable (an ``nnx.Variable`` subtype) holding a
`ScalingState`; ``nnx.Optimizer(..., wrt=nnx.Param)`` never touches it. A module called
several times per step threads its state (it writes the meta it got back to its
variables), so the amaxes of all calls combine by max (see `jax_fp8.meta`).

A loop cannot skip the FP8 update silently: ``nnx.value_and_grad(loss_fn)(model)`` (params
only) over delayed-scaling layers raises at trace time, `apply_gradients` refuses
gradients without the FP8 ones, and `check_fp8_updated` tells a model whose states were
never updated (``jax_fp8.frozen_scales`` opts out on purpose).

Stacked layers: build them with ``nnx.vmap`` (``in_axes=0, out_axes=0`` over split
``Rngs``) and run them with ``nnx.scan`` (the model as a carry-free ``in_axes=0``
argument, or through ``nnx.split``); every `Fp8State` then has a leading layer axis, each
layer uses its own slice, and `update_fp8` updates the ``[n, L]`` stacks in one call.
"""

from __future__ import annotations

# The layers and their variables are _nnx_layers's, the training step's FP8 half
# _nnx_training's. The reference page (docs/reference/nnx.md) lists them in this order.
# isort: off
from jax_fp8.state import ScalingState
from jax_fp8.flax._nnx_layers import (
    Fp8State,
    Fp8Grad,
    Fp8DotGeneral,
    Fp8Einsum,
    Fp8RaggedDot,
    Fp8Linear,
)
from jax_fp8.flax._nnx_training import (
    fp8_state,
    update_fp8,
    fp8_value_and_grad,
    apply_gradients,
    Fp8Pending,
    Fp8Optimizer,
    check_fp8_updated,
)
# isort: on

__all__ = ["Fp8DotGeneral", "Fp8Einsum", "Fp8Grad", "Fp8Linear", "Fp8Optimizer", "Fp8RaggedDot",
           "Fp8Pending", "Fp8State", "ScalingState", "apply_gradients", "check_fp8_updated",
           "fp8_state", "fp8_value_and_grad", "update_fp8"]
