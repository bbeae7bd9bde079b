"""Delayed scaling (Transformer Engine's ``DelayedScaling``): each GEMM keeps a state per
tensor (input, kernel, gradient) whose scale comes from earlier steps' amaxes.

The GEMM: the input (lhs) and kernel (rhs) are quantized with their states' current scales
(E4M3), the FP8 GEMM runs, and its result is dequantized. Backward: the incoming gradient
is quantized (E5M2 under HYBRID) and both gradients are FP8 GEMMs (``_gemms.py``). The
amaxes observed on the way leave as the meta's cotangent (``jax_fp8.meta``), and
`jax_fp8.new_fp8_state` updates every state of a model with one fused op.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jax_fp8 import _trace_checks, meta as meta_lib, recipe as recipe_lib
from jax_fp8._primitives import amax as amax_lib, layout
from jax_fp8.gemm import _ad, _gemms, _grouped
from jax_fp8.meta import Fp8Meta
from jax_fp8.quantization import compute_amax, quantize
from jax_fp8.quantization.current import scale_inverse
from jax_fp8.recipe import Format
from jax_fp8.state import ScalingState, new_state

__all__ = ["DelayedScaling"]


@recipe_lib.register
@dataclasses.dataclass(frozen=True)
class DelayedScaling(recipe_lib.Recipe):
    """Delayed-scaling recipe: how every FP8 state of a model is updated.

    Attributes:
      history_len: length L of each amax history (>= 1).
      amax_compute_algo: "max" (max over the history) or "most_recent".
      margin: scale = fp8_max * 2**-margin / amax.
      fp8_format: Format.E4M3 or Format.HYBRID (E5M2 gradients).
      power_of_2_scale: round each scale down to a power of two.
      skip_unused: leave a state untouched when its staged amax is 0.
    """

    keeps_state: ClassVar[bool] = True
    auto_min_fp8_flops: ClassVar[float] = 2.0 ** 36
    # Its quantize and GEMMs widen or take any floating operand (its layers under x64).
    takes_float64: ClassVar[bool] = True
    # One scale per tensor, as delayed scaling's, taken from the tensor itself.
    stand_in: ClassVar[str | None] = "Float8CurrentScaling"

    history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: float = 0.0
    fp8_format: Format = Format.HYBRID
    power_of_2_scale: bool = False
    skip_unused: bool = False

    def __post_init__(self) -> None:
        if (isinstance(self.history_len, bool)
                or not isinstance(self.history_len, (int, np.integer))
                or self.history_len < 1):
            raise ValueError(f"history_len must be an integer >= 1, got {self.history_len!r}")
        recipe_lib.check_algorithm(self.amax_compute_algo)
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"fp8_format must be a jax_fp8.Format, got {self.fp8_format!r}")
        for dtype in (self.fp8_format.fwd_dtype, self.fp8_format.bwd_dtype):
            recipe_lib.scaled_max(dtype, self.margin)  # validates margin
        recipe_lib._check_bool(self, "power_of_2_scale", "skip_unused")

    def state_dtypes(self) -> dict[str, np.dtype]:
        fwd, bwd = self.fp8_format.fwd_dtype, self.fp8_format.bwd_dtype
        return {"input": fwd, "kernel": fwd, "grad": bwd}

    def state_history_len(self) -> int:
        return self.history_len

    def create_state(self, role: str, shape: Sequence[int] = (),
                     history_len: int | None = None) -> ScalingState:
        return new_state(self, role, shape, history_len)

    def create_meta(self, shape: Sequence[int] = (), history_len: int | None = None,
                    ) -> Fp8Meta:
        input_, kernel, grad = (self.create_state(role, shape, history_len)
                                for role in Fp8Meta.STATES)
        return Fp8Meta(input=input_, kernel=kernel, grad=grad)

    def check_meta(self, meta: Any, name: str = "meta", shape: Sequence[int] = ()) -> None:
        if meta.recipe is not None:
            raise TypeError(f"{name}.recipe: a delayed-scaling meta holds states, not a "
                            f"recipe; make it with Fp8Meta.create(DelayedScaling(...))")
        for field in Fp8Meta.STATES:
            st = getattr(meta, field)
            if not isinstance(st, ScalingState):
                raise TypeError(f"{name}.{field} must be a ScalingState, got "
                                f"{type(st).__name__}")
            for leaf_name in ("amax_history", "scale", "scale_inv"):
                leaf = getattr(st, leaf_name)
                if not hasattr(leaf, "shape") or getattr(leaf, "dtype", None) != jnp.float32:
                    raise TypeError(f"{name}.{field}.{leaf_name} must be a float32 array, got "
                                    f"{getattr(leaf, 'dtype', type(leaf).__name__)}")
            shape = tuple(shape)
            if tuple(st.scale.shape) != shape or tuple(st.scale_inv.shape) != shape \
                    or st.amax_history.ndim != len(shape) + 1:
                if shape:
                    raise ValueError(
                        f"{name}.{field} must hold one state per expert (scale shape "
                        f"{shape}, history {list(shape) + ['L']}), got scale shape "
                        f"{tuple(st.scale.shape)}; make it with "
                        f"Fp8Meta.create(DelayedScaling(...), shape={shape})")
                raise ValueError(f"{name}.{field} must be the state of one tensor (scale "
                                 f"shape (), history [L]), got scale shape "
                                 f"{tuple(st.scale.shape)}; for stacked layers slice the meta "
                                 f"per layer (lax.scan xs / nn.scan)")

    def dot_general(self, lhs: jax.Array, rhs: jax.Array,
                    dimension_numbers: lax.DotDimensionNumbers, meta: Fp8Meta,
                    out_dtype: np.dtype) -> tuple[jax.Array, Fp8Meta]:
        _trace_checks.claim(meta, "fp8_dot_general", (lhs, rhs))
        return _fp8_dot(lhs, rhs, meta, dimension_numbers, out_dtype, np.dtype(lhs.dtype),
                        np.dtype(rhs.dtype))

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, meta: Fp8Meta,
                   out_dtype: np.dtype) -> tuple[jax.Array, Fp8Meta]:
        _trace_checks.claim(meta, "fp8_ragged_dot", (lhs, rhs))
        ends = _grouped.clamped_group_ends(group_sizes, lhs.shape[0])
        return _fp8_ragged(lhs, rhs, ends, meta, out_dtype, np.dtype(lhs.dtype),
                           np.dtype(rhs.dtype))


# ------------------------------------------------------------- the GEMM and its custom VJP
# A `meta` whose states are read is typed Any: Fp8Meta types its states Optional (None for
# the stateless recipes), a delayed-scaling meta's never are.

def _dequantization_factor(state: ScalingState) -> jax.Array:
    """``1 / state.scale``, derived at use: the stored ``scale_inv`` is not read, so a
    state whose two floats were changed apart (an average of states, e.g. an EMA of the
    variables) still dequantizes what it quantized. The same bits as the update's
    ``scale_inv`` (docs/semantics.md)."""
    return scale_inverse(state.scale)


def _fwd(lhs: jax.Array, rhs: jax.Array, meta: Any, dimension_numbers: lax.DotDimensionNumbers,
         out_dtype: np.dtype) -> tuple[tuple[jax.Array, Fp8Meta], tuple[Any, ...]]:
    q_lhs, q_rhs = quantize(lhs, meta.input), quantize(rhs, meta.kernel)
    out = _gemms.gemm(q_lhs, *_gemms.rhs_for_forward(q_rhs, dimension_numbers),
                      _dequantization_factor(meta.input), _dequantization_factor(meta.kernel),
                      out_dtype)
    # The meta is returned unchanged: its only job is to carry the cotangent chain.
    # Empty slices of lhs and rhs carry the primal inputs' manual-axis types (shard_map's
    # vma) to the backward rule.
    res = (_gemms.lhs_for_kernel_grad(q_lhs, dimension_numbers), q_rhs, meta,
           compute_amax(lhs), compute_amax(rhs), _empty_slice(lhs), _empty_slice(rhs))
    return (out, meta), res


def _empty_slice(x: jax.Array) -> jax.Array:
    """x[:0, ..., :0]: no elements, x's rank and types. A slice, not a reshape: flattening
    an array sharded along a minor axis on a mesh with Explicit axes is a
    ShardingTypeError."""
    return lax.slice(x, (0,) * x.ndim, (0,) * x.ndim)


def _to_primal_vma(ct: Any, primal_like: Any, reduce: Callable[[Any, tuple[str, ...]], Any],
                   ) -> Any:
    """Inside shard_map (check_vma): a cotangent varying over manual axes its primal
    does not vary over is reduced over them: summed for a gradient, as the transpose of
    JAX's implicit broadcast is, and max-ed for an amax."""
    extra = tuple(sorted(amax_lib.varying_axes(ct) - amax_lib.varying_axes(primal_like)))
    return reduce(ct, extra) if extra else ct


def _pmax_ignoring_nan(x: Any, axes: tuple[str, ...]) -> Any:
    # As reduce_amaxes: a NaN amax on one device is ignored, not spread to all. ``x`` an
    # array or a tuple of arrays (one all-reduce for all of them).
    return lax.pmax(  # type: ignore[no-untyped-call]  # unannotated in JAX
        jax.tree.map(lambda a: jnp.where(jnp.isnan(a), -jnp.inf, a), x), axes)


def _bwd_tail(grad_lhs: jax.Array, grad_rhs: jax.Array, lhs_like: jax.Array, rhs_like: jax.Array,
              meta: Any, ct_meta: Any, amaxes: Sequence[jax.Array],
              ) -> tuple[jax.Array, jax.Array, Fp8Meta]:
    """The end of a delayed-scaling GEMM's backward (dense and grouped): the meta's
    cotangent, each state's amax record of fmax(downstream uses' amax, the ``amaxes``
    (input, kernel, gradient) this use observed) (`jax_fp8.meta.amax_cotangent`), those
    max-reduced first over the axes of a ``pmap`` (or ``shard_map(check_vma=False)``)
    being traced; then, inside shard_map (check_vma), the operand gradients summed and the
    amaxes max-ed over the manual axes their primals (``lhs_like``, ``rhs_like``,
    ``meta``) do not vary over.
    Returns (grad_lhs, grad_rhs, the meta's cotangent)."""
    devices = _trace_checks.unreduced_device_axes()
    if devices:
        # Inside pmap (or shard_map(check_vma=False)), where JAX does not say what varies
        # over the devices: every device's record holds the max over them, so generic
        # code that averages or sums the gradient tree over the devices (``lax.pmean``)
        # leaves each record's amax as it is (`jax_fp8._fp8_grads.recorded_amax`).
        amaxes = _pmax_ignoring_nan(tuple(amaxes), devices)
    def to_state(amax: jax.Array, primal: ScalingState) -> jax.Array:
        return cast(jax.Array, _to_primal_vma(amax, primal.scale, _pmax_ignoring_nan))

    amax_lhs, amax_rhs, amax_g = amaxes
    ct_meta_in = Fp8Meta(
        input=meta_lib.amax_cotangent(ct_meta.input, amax_lhs, meta.input, to_state),
        kernel=meta_lib.amax_cotangent(ct_meta.kernel, amax_rhs, meta.kernel, to_state),
        grad=meta_lib.amax_cotangent(ct_meta.grad, amax_g, meta.grad, to_state))
    grad_lhs = _to_primal_vma(grad_lhs, lhs_like, lax.psum)
    grad_rhs = _to_primal_vma(grad_rhs, rhs_like, lax.psum)
    return grad_lhs, grad_rhs, ct_meta_in


def _bwd(dimension_numbers: lax.DotDimensionNumbers, out_dtype: np.dtype, lhs_dtype: np.dtype,
         rhs_dtype: np.dtype, res: Any, cts: tuple[Any, Any],
         ) -> tuple[jax.Array, jax.Array, Fp8Meta]:
    g, ct_meta = cts
    if isinstance(g, SymbolicZero):  # only the threaded meta is used downstream
        aval: Any = g.aval
        g = jnp.zeros(aval.shape, aval.dtype)
    res, g = _ad.first_order_only((_ad.reveal(res), g), "fp8_dot_general")
    lhs_res, q_rhs, meta, amax_lhs, amax_rhs, lhs_like, rhs_like = res
    perm = _gemms.kernel_grad_layout(dimension_numbers, lhs_res.ndim)
    n_fl = _gemms.lhs_free_axes(g, q_rhs, dimension_numbers[0][1])
    g_t = None
    if perm is not None and 0 < n_fl < g.ndim and layout.quantize_rotate_applies(
            g, meta.grad.fp8_dtype):
        # One pass over g for its FP8 copy, that copy transposed for the kernel gradient,
        # and its amax (on CUDA a kernel of jax_fp8's; XLA would take three).
        q_g, g_t, amax_g = layout.quantize_rotate(g, n_fl, meta.grad.scale,
                                                  meta.grad.fp8_dtype)
    else:
        amax_g = compute_amax(g)
        q_g = quantize(g, meta.grad)
    lhs_aval = lhs_res if perm is None else _gemms.untransposed_aval(lhs_res, perm)
    grad_lhs = _gemms.input_grad(q_g, lhs_aval, q_rhs, dimension_numbers, lhs_dtype,
                                 (_dequantization_factor(meta.grad),
                                  _dequantization_factor(meta.kernel)))
    if perm is None:
        grad_rhs = _gemms.rhs_grad(q_g, lhs_res, q_rhs, dimension_numbers, rhs_dtype,
                                   (_dequantization_factor(meta.grad),
                                    _dequantization_factor(meta.input)))
    else:
        grad_rhs = _gemms.kernel_grad(q_g, lhs_res, q_rhs, dimension_numbers, rhs_dtype,
                                      (_dequantization_factor(meta.input),
                                       _dequantization_factor(meta.grad)), g_t=g_t)
    return _bwd_tail(grad_lhs, grad_rhs, lhs_like, rhs_like, meta, ct_meta,
                     (amax_lhs, amax_rhs, amax_g))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_dot(lhs: jax.Array, rhs: jax.Array, meta: Fp8Meta,
             dimension_numbers: lax.DotDimensionNumbers, out_dtype: np.dtype,
             lhs_dtype: np.dtype, rhs_dtype: np.dtype) -> tuple[jax.Array, Fp8Meta]:
    del lhs_dtype, rhs_dtype
    return _fwd(lhs, rhs, meta, dimension_numbers, out_dtype)[0]


def _fwd_rule(lhs: Any, rhs: Any, meta: Any, dimension_numbers: lax.DotDimensionNumbers,
              out_dtype: np.dtype, lhs_dtype: np.dtype, rhs_dtype: np.dtype,
              ) -> tuple[tuple[jax.Array, Fp8Meta], Any]:
    # symbolic_zeros=True: the primals arrive wrapped.
    del lhs_dtype, rhs_dtype
    lhs, rhs, meta = jax.tree.map(lambda p: p.value, (lhs, rhs, meta),
                                  is_leaf=lambda p: isinstance(p, jax.custom_derivatives.
                                                               CustomVJPPrimal))
    lhs, rhs, meta = _ad.first_order_only((lhs, rhs, meta), "fp8_dot_general")
    out, res = _fwd(lhs, rhs, meta, dimension_numbers, out_dtype)
    # Stored as integers: remat policies that save residuals leave their bytes alone.
    return out, _ad.hide(res)


# symbolic_zeros: the backward rule sees which cotangents are known zeros (an unused
# threaded meta), see meta.amax_cotangent.
_fp8_dot.defvjp(_fwd_rule, _bwd, symbolic_zeros=True)


# ---------------------------------------------------- the grouped GEMM (fp8_ragged_dot)
# One state per expert for the input, the kernel and the gradient (leading axis G): group
# g's rows are quantized with meta.input's scale [g] (the gradient's with meta.grad's),
# expert g's weight with meta.kernel's; the amaxes observed are per group of rows (0 for
# an empty group) and per expert (jax_fp8.gemm._grouped.group_amax / expert_amax).

def _quantize_rows(x: jax.Array, state: ScalingState, group: jax.Array) -> jax.Array:
    """x [M, C] quantized with the scale of each row's group (the saturating cast of
    `jax_fp8.quantize`)."""
    fmax = np.float32(recipe_lib.fp8_max(state.fp8_dtype))
    scale = _grouped.rows_of(state.scale.astype(jnp.float32), group)[:, None]
    return jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(state.fp8_dtype)


def _ragged_fwd(lhs: jax.Array, rhs: jax.Array, ends: jax.Array, meta: Any,
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array,
                           tuple[jax.Array, jax.Array]]:
    """(q_lhs, q_rhs [G, K, N], q_rhs swapped [G, N, K], each row's group, the amaxes)."""
    group = _grouped.row_groups(ends, lhs.shape[0])
    groups = ends.shape[0]
    q_lhs = _quantize_rows(lhs, meta.input, group)
    amax_lhs = _grouped.group_amax(lhs, group, groups)
    if layout.quantize_rotate_applies(rhs, meta.kernel.fp8_dtype):
        # the expert weights quantized, transposed for the forward GEMM (K-major) and their
        # amaxes taken in one pass (one kernel on CUDA): the same bits as the three below
        q_rhs, q_rhs_t, amax_rhs = layout.quantize_transpose_experts(
            rhs, meta.kernel.scale, meta.kernel.fp8_dtype)
        return q_lhs, q_rhs, q_rhs_t, group, (amax_lhs, amax_rhs)
    q_rhs = quantize(rhs, meta.kernel)                               # [G, K, N]
    return (q_lhs, q_rhs, jnp.swapaxes(q_rhs, 1, 2), group,
            (amax_lhs, _grouped.expert_amax(rhs)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_ragged(lhs: jax.Array, rhs: jax.Array, ends: jax.Array, meta: Fp8Meta, out_dtype: np.dtype,
                lhs_dtype: np.dtype, rhs_dtype: np.dtype) -> tuple[jax.Array, Fp8Meta]:
    del lhs_dtype, rhs_dtype
    return _fp8_ragged_fwd_rule_impl(lhs, rhs, ends, meta, out_dtype)[0]


def _fp8_ragged_fwd_rule_impl(lhs: jax.Array, rhs: jax.Array, ends: jax.Array, meta: Any,
                              out_dtype: np.dtype,
                              ) -> tuple[tuple[jax.Array, Fp8Meta], tuple[Any, ...]]:
    q_lhs, q_rhs, q_rhs_t, group, (amax_lhs, amax_rhs) = _ragged_fwd(lhs, rhs, ends, meta)
    out = _grouped.grouped(q_lhs, q_rhs_t, ends,
                           _dequantization_factor(meta.input),
                           _dequantization_factor(meta.kernel), out_dtype)
    return (out, meta), (q_lhs, q_rhs, ends, group, meta, amax_lhs, amax_rhs,
                         _empty_slice(lhs), _empty_slice(rhs))


def _fp8_ragged_fwd_rule(lhs: Any, rhs: Any, ends: Any, meta: Any, out_dtype: np.dtype,
                         lhs_dtype: np.dtype, rhs_dtype: np.dtype,
                         ) -> tuple[tuple[jax.Array, Fp8Meta], Any]:
    del lhs_dtype, rhs_dtype
    lhs, rhs, ends, meta = jax.tree.map(
        lambda p: p.value, (lhs, rhs, ends, meta),
        is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal))
    lhs, rhs, meta = _ad.first_order_only((lhs, rhs, meta), "fp8_ragged_dot")
    out, res = _fp8_ragged_fwd_rule_impl(lhs, rhs, ends, meta, out_dtype)
    return out, _ad.hide(res)


def _fp8_ragged_bwd(out_dtype: np.dtype, lhs_dtype: np.dtype, rhs_dtype: np.dtype, res: Any,
                    cts: tuple[Any, Any]) -> tuple[jax.Array, jax.Array, None, Fp8Meta]:
    del out_dtype
    g, ct_meta = cts
    if isinstance(g, SymbolicZero):  # only the threaded meta is used downstream
        aval: Any = g.aval
        g = jnp.zeros(aval.shape, aval.dtype)
    res, g = _ad.first_order_only((_ad.reveal(res), g), "fp8_ragged_dot")
    q_lhs, q_rhs, ends, group, meta, amax_lhs, amax_rhs, lhs_like, rhs_like = res
    q_g = _quantize_rows(g, meta.grad, group)
    amax_g = _grouped.group_amax(g, group, ends.shape[0])
    si_in, si_kernel, si_grad = (_dequantization_factor(st)
                                 for st in (meta.input, meta.kernel, meta.grad))
    grad_lhs = _grouped.grouped(q_g, q_rhs, ends, si_grad, si_kernel, lhs_dtype)
    grad_rhs = _grouped.scaled_wgrad(q_lhs, q_g, ends, si_in, si_grad, rhs_dtype)
    # Inside shard_map, as fp8_dot_general: gradients summed and amaxes max-ed over the
    # manual axes their primals do not vary over (experts' weights and states replicated
    # beside tokens per device).
    grad_lhs, grad_rhs, ct_meta_in = _bwd_tail(grad_lhs, grad_rhs, lhs_like, rhs_like, meta,
                                               ct_meta, (amax_lhs, amax_rhs, amax_g))
    return grad_lhs, grad_rhs, None, ct_meta_in


_fp8_ragged.defvjp(_fp8_ragged_fwd_rule, _fp8_ragged_bwd, symbolic_zeros=True)
