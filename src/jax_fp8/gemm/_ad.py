"""AD plumbing shared by the FP8 custom VJPs: residuals that remat cannot alter, and a guard against
differentiating them twice.

Residuals. Under ``jax.checkpoint`` / ``nn.remat`` / ``nnx.remat`` with a policy that saves
them, JAX passes every saved floating residual through ``lax.reduce_precision`` to its own
format; for FP8 values that is not the identity (on the CPU it maps 288 and 448 of
``float8_e4m3fn`` to NaN and 2**-7 to 0). `hide` stores each floating leaf as the unsigned
integer of its width (a bitcast, free in XLA) and `reveal` undoes it in the backward rule,
so every policy sees the same bytes the forward produced.

Second order. The FP8 GEMMs' gradients are those of the straight-through estimator,
evaluated on quantized copies; differentiating those gradients again (``jax.hessian``,
``jax.grad(jax.grad(f))``, ``jax.jvp`` of a gradient) would differentiate the quantization
itself and give wrong numbers (zeros where a scale is computed under ``stop_gradient``).
`first_order_only` marks values whose derivative must not be taken: an identity whose JVP
raises, so any outer differentiation that reaches them fails at trace time, also across
``jax.jit`` boundaries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Hidden", "first_order_only", "hide", "reveal"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Hidden:
    """A pytree whose floating leaves are stored as unsigned integers of the same width."""

    leaves: tuple[Any, ...]
    treedef: Any
    dtypes: tuple[Any, ...]


jax.tree_util.register_dataclass(Hidden, data_fields=["leaves"], meta_fields=["treedef", "dtypes"])


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def hide(tree: Any) -> Hidden:
    """``tree`` with every floating array leaf bitcast to the unsigned integer of its width."""
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = tuple(np.dtype(x.dtype) if _is_float(x) else None for x in leaves)
    hidden = tuple(lax.bitcast_convert_type(x, _UINT[d.itemsize]) if d is not None else x
                   for x, d in zip(leaves, dtypes))
    return Hidden(hidden, treedef, dtypes)


def reveal(hidden: Hidden) -> Any:
    """The tree `hide` was given, bit for bit."""
    leaves = [lax.bitcast_convert_type(x, d) if d is not None else x
              for x, d in zip(hidden.leaves, hidden.dtypes)]
    return jax.tree.unflatten(hidden.treedef, leaves)


_SECOND_ORDER = (
    "{op}: its derivative was differentiated again (jax.hessian, jax.grad of a gradient, "
    "jax.jvp/jacfwd of a gradient, or a Hessian-vector product). Its gradient is the "
    "straight-through estimator evaluated on FP8-quantized copies, whose own derivative "
    "jax_fp8 does not define. Compute second-order quantities with the unquantized "
    "function (jax.lax.dot_general / jnp.einsum in place of the FP8 op); first-order "
    "gradients (jax.grad, jax.vjp, jax.checkpoint) are supported.")


def first_order_only(tree: T, op: str) -> T:
    """``tree`` unchanged; differentiating through the result raises a clear error naming
    ``op`` (a symbolically zero tangent does not count)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if _is_float(x)]
    if not arrays:
        return tree
    guarded = _guard(op)(*[leaves[i] for i in arrays])
    for i, x in zip(arrays, guarded):
        leaves[i] = x
    return cast(T, jax.tree.unflatten(treedef, leaves))


_GUARDS: dict[str, Callable[..., tuple[Any, ...]]] = {}


def _guard(op: str) -> Callable[..., tuple[Any, ...]]:
    if op not in _GUARDS:
        @jax.custom_jvp
        def identity(*xs: Any) -> tuple[Any, ...]:
            return xs

        @identity.defjvp
        def _jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
            del primals, tangents
            raise NotImplementedError(_SECOND_ORDER.format(op=op))

        _GUARDS[op] = identity
    return _GUARDS[op]
