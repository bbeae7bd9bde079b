"""The frame of the recipes that scale from the operands themselves (current, blockwise,
MXFP8): `StatelessRecipe`, and `scaled_dot_general`, which brings a ``lax.dot_general`` into
the Dense form x [M, K] . w [K, N] and runs the recipe's forward and backward under one
custom VJP.

``scaled_dot_general(lhs, rhs, dimension_numbers, recipe)`` flattens lhs's free axes into
M and the contracting axes into K (transposes where the axes are not in that order,
reshapes otherwise), runs ``recipe.matmul_forward`` (keeping its residuals for the
backward) and, differentiated, ``recipe.matmul_backward``; batch axes are the ``jax.vmap``
of the product without them, one GEMM per batch element. Each recipe's module says how it
quantizes and which GEMMs it runs (``jax_fp8.recipes.current``, ``.block``, ``.mxfp8``).

The quantization itself is not differentiated (its scales are constants of the step).
Gradients come back in lhs's and rhs's dtypes. The residuals are stored as integers, so
that remat policies that save residuals leave their bytes alone.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import recipe as recipe_lib
from jax_fp8._primitives import axis_types, block_quantize as bq
from jax_fp8.gemm import _ad, _grouped
from jax_fp8.meta import Fp8Meta

__all__ = ["StatelessRecipe", "scaled_dot_general"]

_OP = "fp8_dot_general (a recipe without state)"


class StatelessRecipe(recipe_lib.Recipe):
    """A recipe that keeps no state: each GEMM's scales come from its operands.

    Its meta holds only the recipe (``Fp8Meta(recipe=self)``); `jax_fp8.fp8_dot_general`
    runs `scaled_dot_general`, which calls the two methods a subclass defines on the
    Dense form x [M, K] . w [K, N]:

    * ``matmul_forward(x, w, out_dtype, keep)`` -> ``(out [M, N], residuals)`` (residuals
      None unless ``keep``: a pytree of arrays and static data the backward needs);
    * ``matmul_backward(residuals, g, x_dtype, w_dtype)`` -> ``(dx [M, K], dw [K, N])``.
    """

    keeps_state: ClassVar[bool] = False

    def create_meta(self, shape: Sequence[int] = (), history_len: int | None = None) -> Fp8Meta:
        del shape, history_len  # nothing to keep
        return Fp8Meta(recipe=self)

    def check_meta(self, meta: Any, name: str = "meta", shape: tuple[int, ...] = ()) -> None:
        del shape  # no states
        for field in Fp8Meta.STATES:
            if getattr(meta, field) is not None:
                raise TypeError(f"{name}.{field} must be None for {type(self).__name__} "
                                f"(a stateless recipe)")

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, meta: Any,
                    out_dtype: np.dtype) -> tuple[jax.Array, Any]:
        return scaled_dot_general(lhs, rhs, dimension_numbers, self, out_dtype), meta

    def ragged_dot(self, lhs: Any, rhs: Any, group_sizes: Any, meta: Any,
                   out_dtype: np.dtype) -> tuple[jax.Array, Any]:
        return scaled_ragged_dot(lhs, rhs, group_sizes, self, out_dtype), meta

    def ragged_forward(self, x: jax.Array, w: jax.Array, ends: jax.Array, out_dtype: np.dtype,
                       keep: bool) -> tuple[jax.Array, Any]:
        """x [M, K] . w[g] [K, N] per group of rows (`jax_fp8.gemm._grouped`; ``ends``: the
        clamped group ends, int32 [G]) -> ([M, N] in out_dtype, residuals or None)."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped (ragged_dot) GEMM")

    def ragged_backward(self, residuals: Any, g: jax.Array, ends: jax.Array, x_dtype: np.dtype,
                        w_dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
        """The gradients (dx [M, K] in x_dtype, dw [G, K, N] in w_dtype) for g [M, N]."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped (ragged_dot) GEMM")

    @abc.abstractmethod
    def matmul_forward(self, x: jax.Array, w: jax.Array, out_dtype: np.dtype,
                       keep: bool) -> tuple[jax.Array, Any]:
        """x [M, K] . w [K, N] -> ([M, N] in out_dtype, residuals or None)."""

    @abc.abstractmethod
    def matmul_backward(self, residuals: Any, g: jax.Array, x_dtype: np.dtype,
                        w_dtype: np.dtype) -> tuple[jax.Array, jax.Array]:
        """The gradients (dx [M, K] in x_dtype, dw [K, N] in w_dtype) for g [M, N]."""


def scaled_dot_general(lhs: ArrayLike, rhs: ArrayLike,
                       dimension_numbers: lax.DotDimensionNumbers, recipe: StatelessRecipe,
                       preferred_element_type: DTypeLike | None = None) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` with FP8 GEMMs per ``recipe``.

    Shapes: those of ``lax.dot_general``: lhs [B..., L..., C...] and rhs [B..., C..., R...]
    (the batch axes B and contracting axes C anywhere, as ``dimension_numbers = ((lhs_contracting,
    rhs_contracting), (lhs_batch, rhs_batch))`` says) -> out [B..., L..., R...] in
    ``preferred_element_type`` (default: the operands' result type).

    Batch axes: the result is, bit for bit, ``jax.vmap`` of the call without them over the
    batch axes (flattened into one), so each batch element is a GEMM of its own: under
    current scaling each element's lhs and rhs slice has its own scale (its own amax), and
    block scaling's blocks never span two elements.

    Differentiable once, under any remat policy; differentiating the gradient again
    raises ``NotImplementedError`` at trace time (as `jax_fp8.fp8_dot_general`).

    Args:
      recipe: a recipe that keeps no state (`StatelessRecipe`: ``Float8CurrentScaling``,
        ``Float8BlockScaling``, ``MXFP8BlockScaling``).

    Example (a Dense layer):

        y = scaled_dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                               jax_fp8.Float8BlockScaling())   # x [B, T, D], kernel [D, H]
    """
    if not isinstance(recipe, StatelessRecipe):
        offered = recipe_lib.spoken([f"jax_fp8.{n}" if i == 0 else n for i, n in
                                     enumerate(recipe_lib.without_state())])
        raise TypeError(f"recipe must be a recipe that keeps no state ({offered}), got "
                        f"{type(recipe).__name__}")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, a in (("lhs", lhs), ("rhs", rhs)):
        if np.dtype(a.dtype) not in bq.INPUT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {a.dtype}")
    (lc, rc), (lb, rb) = dimension_numbers
    lc, lb = (tuple(int(a) % lhs.ndim for a in axes) for axes in (lc, lb))
    rc, rb = (tuple(int(a) % rhs.ndim for a in axes) for axes in (rc, rb))
    if (len(lc) != len(rc) or len(set(lc)) != len(lc) or len(set(rc)) != len(rc)
            or any(lhs.shape[a] != rhs.shape[b] for a, b in zip(lc, rc))):
        raise ValueError(f"scaled_dot_general: contracting dimensions {lc} of lhs "
                         f"{lhs.shape} and {rc} of rhs {rhs.shape} do not match")
    if (len(lb) != len(rb) or len(set(lb)) != len(lb) or len(set(rb)) != len(rb)
            or set(lb) & set(lc) or set(rb) & set(rc)
            or any(lhs.shape[a] != rhs.shape[b] for a, b in zip(lb, rb))):
        raise ValueError(f"scaled_dot_general: batch dimensions {lb} of lhs {lhs.shape} and "
                         f"{rb} of rhs {rhs.shape} do not match (or overlap the contracting "
                         f"ones)")
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else jnp.result_type(lhs, rhs))
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"preferred_element_type must be floating, got {out_dtype}")
    if not lb:
        return _unbatched(lhs, rhs, lc, rc, recipe, out_dtype)
    # Batch axes first and flattened into one, the rest in their order; vmap over it.
    lr = [a for a in range(lhs.ndim) if a not in lb]
    rr = [a for a in range(rhs.ndim) if a not in rb]
    batch_shape = tuple(lhs.shape[a] for a in lb)
    lhs_b = _permute(lhs, list(lb) + lr).reshape((-1,) + tuple(lhs.shape[a] for a in lr))
    rhs_b = _permute(rhs, list(rb) + rr).reshape((-1,) + tuple(rhs.shape[a] for a in rr))
    inner_lc = tuple(lr.index(a) for a in lc)
    inner_rc = tuple(rr.index(a) for a in rc)
    out = jax.vmap(lambda a, b: _unbatched(a, b, inner_lc, inner_rc, recipe, out_dtype))(
        lhs_b, rhs_b)
    return out.reshape(batch_shape + out.shape[1:])


def _unbatched(lhs: jax.Array, rhs: jax.Array, lc: tuple[int, ...], rc: tuple[int, ...],
               recipe: StatelessRecipe, out_dtype: np.dtype) -> jax.Array:
    """scaled_dot_general without batch axes: the operands as x [M, K] and w [K, N].

    On a mesh with Explicit axes the free axes that are sharded are moved ahead of the
    others before they are merged into M (N), and moved back in the result: JAX's
    reshape merges a sharded axis only as the major one (``[4, 40@data, 64]`` into
    ``[160, 64]`` is a ShardingTypeError, ``[40@data, 4, 64]`` into ``[160@data, 64]``
    is local). The rows (columns) of the Dense form are then in another order; every
    row's product is the same, and so are current scaling's per-tensor scales.
    """
    lf = _sharded_first(lhs, [a for a in range(lhs.ndim) if a not in lc])
    rf = _sharded_first(rhs, [a for a in range(rhs.ndim) if a not in rc])
    m = math.prod(lhs.shape[a] for a in lf)
    k = math.prod(lhs.shape[a] for a in lc)
    n = math.prod(rhs.shape[a] for a in rf)
    x = _permute(lhs, lf + list(lc)).reshape(m, k)
    w = _permute(rhs, list(rc) + rf).reshape(k, n)
    x, w = axis_types.vary_like([x, w])
    out = _fp8_matmul(x, w, recipe, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    out = out.reshape(tuple(lhs.shape[a] for a in lf) + tuple(rhs.shape[a] for a in rf))
    # Back to dot_general's order: lhs's free axes, then rhs's, each in ascending order.
    produced = lf + [lhs.ndim + a for a in rf]
    return _permute(out, [int(i) for i in np.argsort(produced)])


def _sharded_first(a: jax.Array, axes: list[int]) -> list[int]:
    """`axes` (free axes of `a`, ascending) with those sharded on a mesh with Explicit
    axes first, each group in its order; `axes` unchanged elsewhere."""
    if not axis_types.on_explicit_mesh(a):
        return axes
    spec = tuple(jax.typeof(a).sharding.spec)
    spec = spec + (None,) * (a.ndim - len(spec))
    return [i for i in axes if spec[i] is not None] + [i for i in axes if spec[i] is None]


def _permute(a: jax.Array, perm: Sequence[int]) -> jax.Array:
    return a if list(perm) == list(range(a.ndim)) else lax.transpose(a, tuple(perm))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_matmul(x: jax.Array, w: jax.Array, recipe: StatelessRecipe, out_dtype: np.dtype,
                x_dtype: np.dtype, w_dtype: np.dtype) -> jax.Array:
    """x [M, K] . w [K, N] -> [M, N] in out_dtype."""
    del x_dtype, w_dtype
    return recipe.matmul_forward(x, w, out_dtype, keep=False)[0]


def _fwd(x: jax.Array, w: jax.Array, recipe: StatelessRecipe, out_dtype: np.dtype,
         x_dtype: np.dtype, w_dtype: np.dtype) -> tuple[jax.Array, Any]:
    del x_dtype, w_dtype
    x, w = _ad.first_order_only((x, w), _OP)
    out, residuals = recipe.matmul_forward(x, w, out_dtype, keep=True)
    # Stored as integers: remat policies that save residuals leave their bytes alone.
    return out, _ad.hide(residuals)


def _bwd(recipe: StatelessRecipe, out_dtype: np.dtype, x_dtype: np.dtype, w_dtype: np.dtype,
         residuals: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    del out_dtype
    residuals, g = _ad.first_order_only((_ad.reveal(residuals), g), _OP)
    return recipe.matmul_backward(residuals, g, x_dtype, w_dtype)


_fp8_matmul.defvjp(_fwd, _bwd)


# ---------------------------------------------------------------- grouped GEMMs (MoE)

_RAGGED_OP = "fp8_ragged_dot (a recipe without state)"


def scaled_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                      recipe: StatelessRecipe, out_dtype: DTypeLike) -> jax.Array:
    """``lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` with FP8 GEMMs per
    ``recipe`` (its ``ragged_forward`` / ``ragged_backward``), under one custom VJP. The
    groups are clamped as the grouped GEMM primitive clamps them."""
    ends = _grouped.clamped_group_ends(group_sizes, lhs.shape[0])
    lhs, rhs = axis_types.vary_like([lhs, rhs])   # inside shard_map: as scaled_dot_general
    return _ragged_matmul(lhs, rhs, ends, recipe, np.dtype(out_dtype), np.dtype(lhs.dtype),
                          np.dtype(rhs.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ragged_matmul(x: jax.Array, w: jax.Array, ends: jax.Array, recipe: StatelessRecipe,
                   out_dtype: np.dtype, x_dtype: np.dtype, w_dtype: np.dtype) -> jax.Array:
    del x_dtype, w_dtype
    return recipe.ragged_forward(x, w, ends, out_dtype, keep=False)[0]


def _ragged_fwd(x: jax.Array, w: jax.Array, ends: jax.Array, recipe: StatelessRecipe,
                out_dtype: np.dtype, x_dtype: np.dtype,
                w_dtype: np.dtype) -> tuple[jax.Array, Any]:
    del x_dtype, w_dtype
    x, w = _ad.first_order_only((x, w), _RAGGED_OP)
    out, residuals = recipe.ragged_forward(x, w, ends, out_dtype, keep=True)
    return out, _ad.hide((residuals, ends))


def _ragged_bwd(recipe: StatelessRecipe, out_dtype: np.dtype, x_dtype: np.dtype,
                w_dtype: np.dtype, residuals: Any,
                g: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    del out_dtype
    (residuals, ends), g = _ad.first_order_only((_ad.reveal(residuals), g), _RAGGED_OP)
    dx, dw = recipe.ragged_backward(residuals, g, ends, x_dtype, w_dtype)
    return dx, dw, None


_ragged_matmul.defvjp(_ragged_fwd, _ragged_bwd)


# ------------------------------------------------------------ shardings of the gradients

@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Types:
    """The primals' shardings on a mesh with Explicit axes (None elsewhere), kept with the
    residuals as static data."""
    x: object
    w: object


def explicit_type(a: jax.Array) -> Any:
    """`a`'s sharding on a mesh with Explicit axes, else None."""
    return jax.typeof(a).sharding if axis_types.on_explicit_mesh(a) else None


def typed(grad: jax.Array, sharding: Any) -> jax.Array:
    """`grad` resharded as its primal (`explicit_type`) where that is not None: e.g. a
    slice of a weight gradient the GEMM summed over the sharded batch."""
    # jax.sharding.reshard is unannotated in JAX.
    return grad if sharding is None else jax.sharding.reshard(grad, sharding)  # type: ignore[no-untyped-call]
