"""`Fp8Linear`: ``eqx.nn.Linear`` whose matmul is an FP8 GEMM."""

from __future__ import annotations

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_fp8.equinox._gemm import fp8_gemm
from jax_fp8.equinox._state import Fp8State
from jax_fp8.gemm.dot_general import check_min_fp8_flops

__all__ = ["Fp8Linear"]


class Fp8Linear(eqx.Module):
    """A drop-in for ``eqx.nn.Linear``: the same fields, arguments and call, ``layer(x)``
    on one example (``jax.vmap`` for a batch), with the matmul an FP8 GEMM of ``recipe``
    and its FP8 state in the field ``fp8`` (an `Fp8State`).

    ``y = weight @ x + bias`` runs as ``fp8_dot_general(x, weight)`` (the input quantized
    as the GEMM's input, the weight as its kernel). Under ``jax.vmap`` the batch is one
    GEMM (`jax_fp8.equinox` docstring): its amaxes are the max over the batch, and
    ``min_fp8_flops`` (GEMMs with fewer forward FLOPs, ``2 * batch * M * N * K``, run in
    the operands' dtype) counts the batched GEMM.

    Stacked layers (``eqx.filter_vmap`` over the constructor) get stacked states, one
    per layer, which ``jax.lax.scan`` slices with the weights.
    """

    weight: jax.Array
    bias: jax.Array | None
    fp8: Fp8State
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    min_fp8_flops: float | str = eqx.field(static=True)

    def __init__(self, in_features: int | Literal["scalar"],
                 out_features: int | Literal["scalar"], use_bias: bool = True,
                 dtype: Any = None, *, recipe: Any = None, min_fp8_flops: float | str = 0.0,
                 key: jax.Array) -> None:
        linear = eqx.nn.Linear(in_features, out_features, use_bias, dtype, key=key)
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = use_bias
        self.min_fp8_flops = check_min_fp8_flops(min_fp8_flops)
        self.fp8 = Fp8State.create(recipe)

    @classmethod
    def from_linear(cls, linear: eqx.nn.Linear, recipe: Any = None,
                    min_fp8_flops: float | str = 0.0) -> Fp8Linear:
        """``linear``'s weight and bias in an `Fp8Linear` with fresh FP8 state (stacked
        over the weight's leading axes for layers made by ``eqx.filter_vmap``)."""
        if not isinstance(linear, eqx.nn.Linear):
            raise TypeError(f"from_linear takes an eqx.nn.Linear, got {type(linear).__name__}")
        layer = object.__new__(cls)
        lead = tuple(jnp.shape(linear.weight)[:-2])
        for name, value in (("weight", linear.weight), ("bias", linear.bias),
                            ("fp8", Fp8State.create(recipe, lead)),
                            ("in_features", linear.in_features),
                            ("out_features", linear.out_features),
                            ("use_bias", linear.use_bias),
                            ("min_fp8_flops", check_min_fp8_flops(min_fp8_flops))):
            object.__setattr__(layer, name, value)
        return layer

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """``x``: one example, shape ``(in_features,)`` (``()`` for "scalar"); ``key``
        is ignored (as ``eqx.nn.Linear``'s). Returns shape ``(out_features,)``."""
        del key
        x = jnp.asarray(x)
        if self.in_features == "scalar":
            if jnp.shape(x) != ():
                raise ValueError("x must have scalar shape")
            x = jnp.broadcast_to(x, (1,))
        if x.ndim != 1:
            raise ValueError(f"Fp8Linear takes one example, shape (in_features,); got shape "
                             f"{x.shape}: call it under jax.vmap for a batch (as "
                             f"eqx.nn.Linear)")
        y, _ = fp8_gemm("dot_general", (((0,), (1,)), ((), ())), x, self.weight,
                        self.fp8.meta, min_fp8_flops=self.min_fp8_flops)
        if self.bias is not None:
            y = y + self.bias
        if self.out_features == "scalar":
            y = jnp.squeeze(y)
        return y
