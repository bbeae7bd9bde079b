"""`fp8_dot_general`: ``lax.dot_general`` with FP8 operands and a custom VJP, for any recipe.

Here the call is only checked and canonicalised (the dimension numbers, the operand and
result dtypes, a GEMM kept out of FP8 below ``min_fp8_flops``, float16 run as float32);
the GEMM itself is the meta's recipe's (``recipe.dot_general``, each recipe in its module
under ``jax_fp8.recipes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_fp8 import fp8_pays, recipe as recipe_lib
from jax_fp8.gemm import _gemms
from jax_fp8.meta import Fp8Meta

__all__ = ["fp8_dot_general", "gemm_flops"]


def check_meta(meta: Any, name: str = "meta", shape: tuple[int, ...] = ()) -> recipe_lib.Recipe:
    """The recipe that runs `meta` (its own, or for a meta of states the recipe that keeps
    state), once that recipe has checked it (states of leading axes ``shape``); TypeError /
    ValueError otherwise."""
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"{name} must be a jax_fp8.Fp8Meta, got {type(meta).__name__}")
    if meta.recipe is not None:
        recipe_lib.check_recipe(meta.recipe, f"{name}.recipe")
    recipe = meta.recipe if meta.recipe is not None else recipe_lib.of_states()
    recipe.check_meta(meta, name, shape=shape)
    return recipe


def canonical_dimension_numbers(
        dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int,
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]:
    """((lc, rc), (lb, rb)) as tuples of ints, checked against the operands' ranks."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        dn = ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
              (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))
    except (TypeError, ValueError):
        raise TypeError(f"dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                        f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    (lc, rc), (lb, rb) = dn
    for side, axes, ndim in (("lhs", lc + lb, lhs_ndim), ("rhs", rc + rb, rhs_ndim)):
        if any(not 0 <= a < ndim for a in axes) or len(set(axes)) != len(axes):
            raise ValueError(f"dimension_numbers {dimension_numbers!r}: {side} axes must be "
                             f"distinct and in [0, {ndim})")
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"dimension_numbers {dimension_numbers!r}: lhs and rhs need as many "
                         f"contracting and batch axes")
    return dn


# The name scope of a GEMM that min_fp8_flops keeps in its operands' dtype, and why
# (jax_fp8.devtools.explain reads both); MEASURED_SCOPE: kept by min_fp8_flops="measured"
# (jax_fp8.fp8_pays: not faster in FP8 at its sizes on the platform).
KEPT_SCOPE = "below_min_fp8_flops"
KEPT_REASON = "kept in its operands' dtype: fewer FLOPs than the layer's min_fp8_flops"
MEASURED_SCOPE = "fp8_not_faster"
MEASURED_REASON = ("kept in its operands' dtype: FP8 is not faster at its sizes on this platform "
                   "(min_fp8_flops='measured', jax_fp8.fp8_pays)")


def gemm_flops(lhs_shape: Sequence[int], rhs_shape: Sequence[int],
               dimension_numbers: lax.DotDimensionNumbers) -> int:
    """2 * batch * M * N * K: the FLOPs of ``lax.dot_general`` on these shapes."""
    batch, m, n, k = _gemms.gemm_sizes(lhs_shape, rhs_shape, dimension_numbers)
    return 2 * batch * m * n * k


def check_min_fp8_flops(value: Any, name: str = "min_fp8_flops") -> float | str:
    """`value` as a number of FLOPs (float), or ``"measured"`` (`jax_fp8.fp8_pays`)."""
    if isinstance(value, str) and value == fp8_pays.MEASURED:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of FLOPs (int or float) or 'measured', got "
                        f"{value!r}")
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def kept_out(recipe: Any, min_fp8_flops: float | str, m: int, k: int,
             n: int) -> tuple[str, str] | None:
    """(name scope, why in words) where ``min_fp8_flops`` keeps the GEMM of m rows (batch
    included), k inputs and n outputs in its operands' dtype, else None (FP8)."""
    if isinstance(min_fp8_flops, str):
        converts, why = fp8_pays.decide(recipe, m, k, n)
        return None if converts else (MEASURED_SCOPE, why)
    flops = 2 * m * k * n
    if min_fp8_flops and flops < min_fp8_flops:
        return KEPT_SCOPE, (f"{flops} FLOPs (2 * M * K * N) below min_fp8_flops "
                            f"({min_fp8_flops:.0f})")
    return None


def fp8_dot_general(lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: Any, meta: Fp8Meta,
                    precision: Any = None, preferred_element_type: DTypeLike | None = None, *,
                    min_fp8_flops: float | str = 0, **unused_kwargs: Any,
                    ) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``lax.dot_general``; returns ``(out, meta)``.

    Shapes are those of ``lax.dot_general(lhs, rhs, dimension_numbers)``; lhs is the
    input (activations), rhs the kernel (weights). The GEMM is the meta's recipe's: a meta
    of a recipe without state (``Fp8Meta.create(Float8BlockScaling())``) runs
    ``jax_fp8.gemm.scaled_dot.scaled_dot_general`` and is returned as is. Delayed scaling (the
    rest of this docstring): both are quantized with
    ``meta.input`` / ``meta.kernel`` (their current scales), the FP8 arrays go straight
    into ``lax.dot_general`` and the result is multiplied by both ``1 / scale``. Backward:
    the incoming gradient is quantized with ``meta.grad`` and both the input and the
    kernel gradient are FP8 GEMMs.

    No state is updated here. The observed amaxes come out as the gradient w.r.t. ``meta``
    (see ``jax_fp8.meta``); the returned ``meta`` holds the same values and must be what a
    later use of the same state gets, so the amaxes of all uses combine by max (a second
    use of one meta value is an error). ``precision`` is ignored (FP8 GEMMs have one
    precision); other keyword arguments (e.g. Flax's ``out_sharding``) are accepted and
    ignored.

    Differentiation: reverse mode (``jax.grad``, ``jax.vjp``), under any remat policy
    (``jax.checkpoint``, ``nn.remat``, ``nnx.remat``) with the same bits as without;
    differentiating the gradient again (``jax.hessian``, ``jax.grad`` of a gradient, a
    Hessian-vector product) raises ``NotImplementedError`` at trace time.

    ``min_fp8_flops``: a GEMM too small to gain from FP8 (fewer FLOPs than this, counted
    as ``2 * batch * M * N * K`` of the forward product, see `gemm_flops`) runs as
    ``lax.dot_general`` in the operands' dtype instead, with ``precision`` as given, and
    ``meta`` is returned untouched (a delayed-scaling state then sees no amax). 0, the
    default, keeps every GEMM in FP8. ``"measured"`` (`Fp8Rule`'s default): FP8 only
    where it is faster on the platform at these sizes (`jax_fp8.fp8_pays`: tables measured
    per GPU architecture; every GEMM on the CPU).

    Example:

        meta = jax_fp8.Fp8Meta.create()
        out, meta = jax_fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), meta)

    Returns:
      (out, meta): ``out`` in ``preferred_element_type`` (default: the result type of
      lhs and rhs), and the meta to thread to the next use.
    """
    del unused_kwargs  # precision: used only by a GEMM kept out of FP8
    recipe = check_meta(meta)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got {x.dtype}")
    if preferred_element_type is not None and (
            not jnp.issubdtype(preferred_element_type, jnp.floating)
            or np.dtype(preferred_element_type).itemsize < 2):
        raise TypeError(f"preferred_element_type must be a floating dtype of at least 16 "
                        f"bits, got {preferred_element_type!r}")
    dn = canonical_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else jnp.result_type(lhs, rhs))
    batch, m, n, k = _gemms.gemm_sizes(lhs.shape, rhs.shape, dn)
    kept = kept_out(recipe, check_min_fp8_flops(min_fp8_flops), batch * m, k, n)
    if kept is not None:
        dtype = jnp.result_type(lhs, rhs)
        with jax.named_scope(kept[0]):   # what jax_fp8.devtools.explain reads
            out = lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dn,
                                  precision=precision, preferred_element_type=out_dtype)
        return out, meta
    # float16 operands and results run as float32 inside, rounded to float16 once at the
    # end (the same bits: the FP8 GEMMs' results are float32 either way); a GEMM of FP8
    # values scaled up to fp8_max can exceed float16's range before its scaling.
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    if f16 in (np.dtype(lhs.dtype), np.dtype(rhs.dtype), out_dtype):
        wide_lhs, wide_rhs = (x.astype(f32) if np.dtype(x.dtype) == f16 else x
                              for x in (lhs, rhs))
        out, meta = fp8_dot_general(wide_lhs, wide_rhs, dn, meta,
                                    preferred_element_type=f32 if out_dtype == f16 else out_dtype)
        return out.astype(out_dtype), meta
    return recipe.dot_general(lhs, rhs, dn, meta, out_dtype)
