"""FP8 ops for training with delayed scaling: quantize, an FP8 dot_general, the step update.

Convention (SPEC.md): ``x_fp8 = saturate_cast(x * scale)``, ``x ~= x_fp8 * scale_inv``.

How the observed amaxes get out of the step
-------------------------------------------
`fp8_dot_general` never updates state. It quantizes with the *current* scales (delayed
scaling) and reports what it observed -- the amax of its input, of its kernel and, in the
backward pass, of the incoming gradient -- as the **cotangent of its `Fp8Meta` argument**:
the "gradient" w.r.t. each state's ``amax_history`` is zero except in the staging slot
``[..., 0]``, which holds the observed amax (Flax's ``_overwrite_with_gradient`` idea, but
the gradient is an amax, not a new state). `new_fp8_state(meta, meta_grads, recipe)` then
reads those slots and updates the whole model's FP8 state with ONE `update_states` call.

Why amaxes combine by max and never by sum
------------------------------------------
JAX adds the cotangents of a value that is used twice, so two uses of one `Fp8Meta`
would report ``amax_1 + amax_2``. The op is therefore *threaded*: it returns the meta as
a second output, ``out, meta = fp8_dot_general(x, w, dn, meta)``, and its backward rule
emits ``fmax(cotangent of the meta it returned, its own amax)`` as the cotangent of the
meta it was given. A meta that flows ``meta0 -> use 1 -> meta1 -> use 2 -> meta2`` thus
gets ``max(amax_2, amax_1)``: every use along the chain is max-combined and no value is
ever consumed twice, so JAX never sums. In particular:

* a layer called several times per step: pass the returned meta to the next call (the
  Flax modules in `jax_fp8.flax` do this for you by writing it back to their variable);
* `lax.scan` over a stack of layers: give the per-layer metas as ``xs`` (each iteration
  has its own slice; nothing is shared); a layer reused in every iteration: put its meta
  in the *carry* and return the threaded meta, never close over it;
* gradient accumulation / microbatching: each microbatch's gradient is computed
  separately; combine the FP8 parts with `combine_fp8_grads` (max), not ``+``.

NaN: `compute_amax` propagates NaN on the GPU (XLA's vectorized CPU max can drop it);
combining uses ``fmax`` and the update ``fmaxf``, which ignore NaN, as SPEC.md does for
the staging slot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jax_fp8 import _amax, _transpose
from jax_fp8 import recipe as recipe_lib
from jax_fp8.state import ScalingState
from jax_fp8.update import update_states

__all__ = [
    "Fp8Meta",
    "amax_cotangents",
    "combine_fp8_grads",
    "compute_amax",
    "dequantize",
    "fp8_dot_general",
    "fp8_einsum",
    "new_fp8_state",
    "quantize",
]


# --------------------------------------------------------------------------- basics

def compute_amax(x) -> jax.Array:
    """max |x| over the whole tensor, as a float32 scalar (NaN propagates; 0 if empty)."""
    x = jnp.asarray(x)
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    # Under a multi-device jit: a max over all devices, so the step's amaxes share one
    # all-reduce (see _amax.py).
    return _amax.amax(x)


def _broadcast_to_leading(s, ndim):
    """A per-tensor factor of shape [...] (leading axes of x) as [..., 1, 1, ...]."""
    s = jnp.asarray(s)
    if s.ndim > ndim:
        raise ValueError(f"state has shape {s.shape} but the tensor has only {ndim} axes")
    return s.reshape(s.shape + (1,) * (ndim - s.ndim))


def quantize(x, state: ScalingState) -> jax.Array:
    """Saturating cast of ``x * state.scale`` to ``state.fp8_dtype``.

    Computed in float32: ``clip(x * scale, -fp8_max, fp8_max).astype(fp8_dtype)``. Values
    beyond the range (infinities included) saturate to +-fp8_max; NaN stays NaN (also for
    E4M3, which has a NaN but no infinity). A state with leading axes [...] scales the
    matching leading axes of ``x``.
    """
    x = jnp.asarray(x)
    dtype = state.fp8_dtype
    fmax = np.float32(recipe_lib.fp8_max(dtype))
    y = x.astype(jnp.float32) * _broadcast_to_leading(state.scale.astype(jnp.float32), x.ndim)
    return jnp.clip(y, -fmax, fmax).astype(dtype)


def dequantize(q, state: ScalingState, dtype=jnp.float32) -> jax.Array:
    """``q * state.scale_inv`` in float32, cast to ``dtype``."""
    q = jnp.asarray(q)
    y = q.astype(jnp.float32) * _broadcast_to_leading(state.scale_inv.astype(jnp.float32),
                                                      q.ndim)
    return y.astype(dtype)


# --------------------------------------------------------------------------- Fp8Meta

@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """The FP8 state of one GEMM: its input (lhs), its kernel (rhs) and its output gradient.

    A registered pytree of three `ScalingState`s. With a `DelayedScaling` recipe the input
    and kernel use ``fp8_format.fwd_dtype`` and the gradient ``fp8_format.bwd_dtype``
    (E5M2 under HYBRID).
    """

    input: ScalingState
    kernel: ScalingState
    grad: ScalingState

    @classmethod
    def create(cls, recipe: recipe_lib.DelayedScaling | None = None, shape=(),
               history_len: int | None = None) -> "Fp8Meta":
        recipe = recipe_lib.DelayedScaling() if recipe is None else recipe
        n = recipe.history_len if history_len is None else history_len
        fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
        return cls(input=ScalingState.create(shape, n, fwd),
                   kernel=ScalingState.create(shape, n, fwd),
                   grad=ScalingState.create(shape, n, bwd))


jax.tree_util.register_dataclass(Fp8Meta, data_fields=["input", "kernel", "grad"],
                                 meta_fields=[])


def _is_state(x):
    return isinstance(x, ScalingState)


def _amax_cotangent(ct: ScalingState, amax, primal: ScalingState) -> ScalingState:
    """The cotangent a use hands back: fmax(downstream uses' amax, this use's amax).

    Where nothing downstream used the threaded meta (a symbolic zero cotangent), the
    staging slot is this use's amax itself: fmax(0, amax) would change nothing that the
    update's own fmaxf(h[0], amax) does not already do, and skipping it spares the step
    one scalar kernel per state.
    """
    h = ct.amax_history
    amax = jnp.asarray(amax, jnp.float32)
    if isinstance(h, SymbolicZero):
        zeros = jnp.zeros_like(primal.amax_history)
        staged = amax
    else:
        zeros = jnp.zeros_like(h)
        staged = jnp.fmax(h[..., 0], amax)
    scale_zeros = jnp.zeros_like(primal.scale)
    return ScalingState(zeros.at[..., 0].set(staged), scale_zeros, scale_zeros,
                        fp8_dtype=primal.fp8_dtype)


def amax_cotangents(fp8_grads):
    """The observed amaxes carried by FP8 gradients: each ScalingState -> its staging slot."""
    return jax.tree.map(lambda g: g.amax_history[..., 0], fp8_grads, is_leaf=_is_state)


def new_fp8_state(fp8_states, fp8_grads, recipe: recipe_lib.DelayedScaling | None = None,
                  *, axis_name=None, implementation: str = "auto"):
    """The step's new FP8 state: ONE `update_states` call for every state of the model.

    Args:
      fp8_states: any pytree of ScalingStates (e.g. Fp8Metas, a Flax collection).
      fp8_grads: the gradient of the loss w.r.t. ``fp8_states`` (same structure); the
        staging slot ``amax_history[..., 0]`` of each holds the amax observed this step.
      recipe: the DelayedScaling recipe (margin, algorithm, ...).
      axis_name: inside ``shard_map`` / ``pmap``, the axis (or axes) whose devices'
        amaxes are combined, with one ``pmax`` for all of them (see ``update_states``).
    """
    recipe = recipe_lib.DelayedScaling() if recipe is None else recipe
    return update_states(fp8_states, amax_cotangents(fp8_grads), recipe=recipe,
                         axis_name=axis_name, implementation=implementation)


def combine_fp8_grads(*fp8_grads):
    """Combines the FP8 gradients of several microbatches (or steps) by max, never sum."""
    if not fp8_grads:
        raise ValueError("combine_fp8_grads needs at least one gradient tree")

    def combine(*gs):
        first = gs[0]
        if not _is_state(first):
            return first
        staged = functools.reduce(jnp.fmax, [g.amax_history[..., 0] for g in gs])
        return ScalingState(jnp.zeros_like(first.amax_history).at[..., 0].set(staged),
                            jnp.zeros_like(first.scale), jnp.zeros_like(first.scale_inv),
                            fp8_dtype=first.fp8_dtype)

    return jax.tree.map(combine, *fp8_grads, is_leaf=_is_state)


# --------------------------------------------------------------------------- dot_general

def _remaining(original, *removed_lists):
    removed = set()
    for r in removed_lists:
        removed.update(r)
    return [i for i in original if i not in removed]


def _ranges_like(*xs):
    start = 0
    for x in xs:
        yield range(start, start + len(x))
        start += len(x)


def _transpose_lhs(g, x, y, dimension_numbers, out_dtype, scale_invs, swap_ans=False):
    """d(dot_general(x, y))/dx applied to g (JAX's own rule, written for any y dtype).

    Like JAX's rule it asks for x's own sharding on the result, which a mesh with
    Explicit axes needs when the contraction runs over a sharded (batch) axis. x may be
    an array or just its abstract value (only its rank and sharding are read).
    """
    x_ndim = x.ndim
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(range(x_ndim), x_contract, x_batch)
    y_kept = _remaining(range(y.ndim), y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    unsorted_axes = list(x_batch) + x_kept + x_contract_sorted_by_y
    out_axes = np.argsort(unsorted_axes)
    # HIGHEST: no fast (reduced-precision) FP8 accumulation for the gradient GEMMs, as
    # Flax and Transformer Engine do; the forward GEMM may use it (DEFAULT).
    out = _fp8_gemm(g, y, dims, *scale_invs, out_dtype, precision=lax.Precision.HIGHEST,
                    out_sharding=_permuted_sharding(x, unsorted_axes))
    return lax.transpose(out, tuple(int(a) for a in out_axes))


def _permuted_sharding(x, axes):
    """x's sharding (x an array or an abstract value) with its spec reordered to `axes`,
    or None without a mesh."""
    sharding = getattr(x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x),
                       "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return sharding.update(spec=jax.sharding.PartitionSpec(*(spec[a] for a in axes)))


def _untransposed_aval(x_t, perm):
    """The abstract value of x, given x_t = transpose(x, perm): shape and sharding."""
    aval = jax.typeof(x_t)
    inv = [int(i) for i in np.argsort(perm)]
    shape = tuple(aval.shape[i] for i in inv)
    sharding = _permuted_sharding(x_t, inv)
    return aval.update(shape=shape, sharding=sharding) if sharding is not None else \
        aval.update(shape=shape)


def _transpose_rhs(g, x, y, dimension_numbers, out_dtype, scale_invs):
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(g, y, x, swapped, out_dtype, scale_invs, swap_ans=True)


def _scaled(out, factor, dtype):
    """Dequantizes a GEMM result (already in `dtype`): out * factor.

    For bfloat16 and float32 results the product is taken in `dtype`, right on the GEMM's
    output: XLA then folds the factor into the cuBLASLt FP8 GEMM as its scale (one
    rounding, in float32, inside the GEMM) instead of leaving a multiply for the next
    fusion, which made XLA fuse LayerNorm's backward badly. The factor itself is
    rounded to bfloat16 there (relative error <= 2**-9, the same as one rounding of the
    output). Other dtypes (float16, whose range the factor can exceed) multiply in
    float32.
    """
    if np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
        return out * jnp.asarray(factor).astype(dtype)
    return (out.astype(jnp.float32) * factor).astype(dtype)


def _fp8_gemm(q_a, q_b, dimension_numbers, scale_inv_a, scale_inv_b, out_dtype,
              precision=None, out_sharding=None):
    """dot_general(q_a * scale_inv_a, q_b * scale_inv_b) in out_dtype, for FP8 q_a, q_b:
    the FP8 GEMM, then its result times the product of the two scale_invs (_scaled).
    (Dequantizing each operand by its own scale_inv instead, in float32, makes XLA's
    cuBLASLt FP8 GEMMs write float32 and convert after: 6.8 ms slower per step on the
    H200, scripts/fusion_probe.py gemm_operand_scales.)"""
    out = lax.dot_general(q_a, q_b, dimension_numbers, precision=precision,
                          preferred_element_type=out_dtype, out_sharding=out_sharding)
    return _scaled(out, scale_inv_a * scale_inv_b, out_dtype)


def _quantized_operands(lhs, rhs, meta):
    """The forward's FP8 operands and the amaxes it observes: (q_lhs, q_rhs, amax_lhs,
    amax_rhs). (Its own function so that scripts/fusion_probe.py can try where XLA
    places the amaxes.)"""
    return (quantize(lhs, meta.input), quantize(rhs, meta.kernel), compute_amax(lhs),
            compute_amax(rhs))


def _fp8_dot_fwd(lhs, rhs, meta, dimension_numbers, out_dtype):
    q_lhs, q_rhs, amax_lhs, amax_rhs = _quantized_operands(lhs, rhs, meta)
    # FP8 operands straight into the dot (XLA rewrites this into a cuBLASLt FP8 GEMM on
    # Hopper/Ada), the result dequantized by the product of the two scale_invs.
    out = _fp8_gemm(q_lhs, q_rhs, dimension_numbers, meta.input.scale_inv,
                    meta.kernel.scale_inv, out_dtype)
    # The meta is returned unchanged: its only job is to carry the cotangent chain.
    # lhs[:0], rhs[:0]: empty arrays that carry the primal inputs' manual-axis types
    # (shard_map's vma) to the backward rule.
    res = (_lhs_for_kernel_grad(q_lhs, dimension_numbers), q_rhs, meta, amax_lhs, amax_rhs,
           jnp.ravel(lhs)[:0], jnp.ravel(rhs)[:0])
    return (out, meta), res


def _kernel_grad_layout(dimension_numbers, lhs_ndim):
    """Without batch axes: the order [contracting..., free...] of lhs's axes in which the
    kernel-gradient GEMM contracts over its minor axes (cuBLASLt's FP8 GEMMs take only
    that layout). None with batch axes (the general rule is used then)."""
    (lc, _), (lb, _) = dimension_numbers
    if lb:
        return None
    return tuple(lc) + tuple(_remaining(range(lhs_ndim), lc))


def _lhs_for_kernel_grad(q_lhs, dimension_numbers):
    """The residual for the kernel gradient: the quantized input, already transposed to
    the layout that GEMM wants (contraction over the minor axes), so the backward asks
    for no layout change. Same bytes as the untransposed residual. XLA would not fuse
    the transpose with the quantization anyway, so on CUDA it is jax_fp8's byte-transpose
    kernel (`_transpose.rotate_axes`), as is the gradient's in `_kernel_grad`."""
    perm = _kernel_grad_layout(dimension_numbers, q_lhs.ndim)
    if perm is None or perm == tuple(range(q_lhs.ndim)):
        return q_lhs
    n_c = len(dimension_numbers[0][0])
    if perm == tuple(range(q_lhs.ndim - n_c, q_lhs.ndim)) + tuple(range(q_lhs.ndim - n_c)):
        return _transpose.rotate_axes(q_lhs, q_lhs.ndim - n_c)  # the usual [T..., D] case
    return lax.transpose(q_lhs, perm)


def _lhs_free_axes(g, rhs, rhs_contract):
    """How many leading axes of the output gradient g come from lhs (no batch axes)."""
    return g.ndim - (rhs.ndim - len(rhs_contract))


def _kernel_grad(q_g, lhs_t, q_rhs, dimension_numbers, out_dtype, scale_invs, g_t=None):
    """d(dot_general(lhs, rhs))/d rhs applied to q_g, from `_lhs_for_kernel_grad`'s
    residual: both FP8 operands contract over their minor axes. Shapes, without batch
    axes: lhs_t [C..., F_l...], q_g [F_l..., F_r...] -> [C..., F_r...], returned in rhs's
    axis order. g_t: q_g already rotated to [F_r..., F_l...], if the caller has it."""
    (lc, rc), _ = dimension_numbers
    n_c, n_fl = len(lc), _lhs_free_axes(q_g, q_rhs, rc)
    n_fr = q_g.ndim - n_fl
    if g_t is None:
        g_t = _transpose.rotate_axes(q_g, n_fl)
    dims = ((tuple(range(n_c, lhs_t.ndim)), tuple(range(n_fr, g_t.ndim))), ((), ()))
    rhs_free = _remaining(range(q_rhs.ndim), rc)
    unsorted_axes = list(rc) + rhs_free
    out = _fp8_gemm(lhs_t, g_t, dims, *scale_invs, out_dtype, precision=lax.Precision.HIGHEST,
                    out_sharding=_permuted_sharding(q_rhs, unsorted_axes))
    return lax.transpose(out, tuple(int(a) for a in np.argsort(unsorted_axes)))


def _to_primal_vma(ct, primal_like, reduce):
    """Inside shard_map (check_vma): a cotangent varying over manual axes its primal
    does not vary over is reduced over them: summed for a gradient, as the transpose of
    JAX's implicit broadcast is, and max-ed for an amax."""
    extra = tuple(sorted(_amax.varying_axes(ct) - _amax.varying_axes(primal_like)))
    return reduce(ct, extra) if extra else ct


def _pmax_ignoring_nan(x, axes):
    # As reduce_amaxes: a NaN amax on one device is ignored, not spread to all.
    return lax.pmax(jnp.where(jnp.isnan(x), -jnp.inf, x), axes)


def _fp8_dot_bwd(dimension_numbers, out_dtype, lhs_dtype, rhs_dtype, res, cts):
    lhs_res, q_rhs, meta, amax_lhs, amax_rhs, lhs_like, rhs_like = res
    g, ct_meta = cts
    if isinstance(g, SymbolicZero):  # only the threaded meta is used downstream
        g = jnp.zeros(g.aval.shape, g.aval.dtype)
    perm = _kernel_grad_layout(dimension_numbers, lhs_res.ndim)
    n_fl = _lhs_free_axes(g, q_rhs, dimension_numbers[0][1])
    g_t = None
    if perm is not None and 0 < n_fl < g.ndim and _transpose.quantize_rotate_applies(
            g, meta.grad.fp8_dtype):
        # One pass over g for its FP8 copy, that copy transposed for the kernel gradient,
        # and its amax (on CUDA a kernel of jax_fp8's; XLA would take three).
        q_g, g_t, amax_g = _transpose.quantize_rotate(g, n_fl, meta.grad.scale,
                                                      meta.grad.fp8_dtype)
    else:
        amax_g = compute_amax(g)
        q_g = quantize(g, meta.grad)
    lhs_aval = lhs_res if perm is None else _untransposed_aval(lhs_res, perm)
    grad_lhs = _transpose_lhs(q_g, lhs_aval, q_rhs, dimension_numbers, lhs_dtype,
                              (meta.grad.scale_inv, meta.kernel.scale_inv))
    if perm is None:
        grad_rhs = _transpose_rhs(q_g, lhs_res, q_rhs, dimension_numbers, rhs_dtype,
                                  (meta.grad.scale_inv, meta.input.scale_inv))
    else:
        grad_rhs = _kernel_grad(q_g, lhs_res, q_rhs, dimension_numbers, rhs_dtype,
                                (meta.input.scale_inv, meta.grad.scale_inv), g_t=g_t)
    ct_meta_in = Fp8Meta(input=_amax_cotangent(ct_meta.input, amax_lhs, meta.input),
                         kernel=_amax_cotangent(ct_meta.kernel, amax_rhs, meta.kernel),
                         grad=_amax_cotangent(ct_meta.grad, amax_g, meta.grad))
    grad_lhs = _to_primal_vma(grad_lhs, lhs_like, lax.psum)
    grad_rhs = _to_primal_vma(grad_rhs, rhs_like, lax.psum)
    ct_meta_in = jax.tree.map(
        lambda ct, primal: _to_primal_vma(ct, primal, _pmax_ignoring_nan), ct_meta_in, meta)
    return grad_lhs, grad_rhs, ct_meta_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_dot_threaded(lhs, rhs, meta, dimension_numbers, out_dtype, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    return _fp8_dot_fwd(lhs, rhs, meta, dimension_numbers, out_dtype)[0]


def _fwd_rule(fwd):
    """The custom_vjp forward rule (symbolic_zeros=True: primals arrive wrapped) of
    `fwd(lhs, rhs, meta, dimension_numbers, out_dtype)`."""
    def rule(lhs, rhs, meta, dimension_numbers, out_dtype, lhs_dtype, rhs_dtype):
        del lhs_dtype, rhs_dtype
        lhs, rhs, meta = jax.tree.map(lambda p: p.value, (lhs, rhs, meta),
                                      is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
        return fwd(lhs, rhs, meta, dimension_numbers, out_dtype)
    return rule


_fp8_dot_fwd_rule = _fwd_rule(_fp8_dot_fwd)


# symbolic_zeros: the backward rule sees which cotangents are known zeros (an unused
# threaded meta), see _amax_cotangent.
_fp8_dot_threaded.defvjp(_fp8_dot_fwd_rule, _fp8_dot_bwd, symbolic_zeros=True)


def _check_meta(meta):
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"meta must be a jax_fp8.Fp8Meta, got {type(meta).__name__}")
    for name in ("input", "kernel", "grad"):
        st = getattr(meta, name)
        if not isinstance(st, ScalingState):
            raise TypeError(f"meta.{name} must be a ScalingState, got {type(st).__name__}")
        if tuple(st.scale.shape) != ():
            raise ValueError(f"meta.{name} must be the state of one tensor (scale shape ()), "
                             f"got scale shape {tuple(st.scale.shape)}; for stacked layers "
                             f"slice the meta per layer (lax.scan xs / nn.scan)")


def _canonical_dn(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
            (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))


def fp8_dot_general(lhs, rhs, dimension_numbers, meta: Fp8Meta, precision=None,
                    preferred_element_type=None, **unused_kwargs):
    """FP8 ``lax.dot_general`` with delayed scaling; returns ``(out, meta)``.

    Forward: lhs (input) and rhs (kernel) are quantized with ``meta.input`` /
    ``meta.kernel`` current scales (E4M3), the FP8 arrays go straight into
    ``lax.dot_general`` and the result is multiplied by both scale_invs. Backward: the
    incoming gradient is quantized with ``meta.grad`` (E5M2 under HYBRID) and both the
    input and the kernel gradient are FP8 GEMMs.

    No state is updated here. The observed amaxes come out as the gradient w.r.t. ``meta``
    (see the module docstring); the returned ``meta`` is the same values, to be passed to a
    later use of the same state so the amaxes of all uses combine by max. ``precision`` is
    ignored (FP8 GEMMs have one precision); other keyword arguments (e.g. Flax's
    ``out_sharding``) are accepted and ignored.

    Returns:
      (out, meta): ``out`` in ``preferred_element_type`` (default: the result type of
      lhs and rhs), and the meta to thread to the next use.
    """
    del precision, unused_kwargs
    _check_meta(meta)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array, got {x.dtype}")
    out_dtype = np.dtype(preferred_element_type if preferred_element_type is not None
                         else jnp.result_type(lhs, rhs))
    return _fp8_dot_threaded(lhs, rhs, meta, _canonical_dn(dimension_numbers), out_dtype,
                             np.dtype(lhs.dtype), np.dtype(rhs.dtype))


def fp8_einsum(eqn: str, lhs, rhs, meta: Fp8Meta, preferred_element_type=None):
    """Two-operand einsum (``"...,...->..."``) as one `fp8_dot_general`; returns (out, meta).

    Letters in both operands and the output are batch axes, in both operands only are
    contracted, in one operand only are kept (or summed first when absent from the output).
    Repeated letters within one operand (diagonals) and ellipses are not supported.
    """
    eqn = eqn.replace(" ", "")
    if "..." in eqn:
        raise ValueError("fp8_einsum does not support '...'")
    if "->" not in eqn:
        raise ValueError("fp8_einsum needs an explicit output: 'ab,bc->ac'")
    ins, out = eqn.split("->")
    parts = ins.split(",")
    if len(parts) != 2:
        raise ValueError(f"fp8_einsum takes exactly two operands, got {eqn!r}")
    a, b = parts
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, spec, x in (("lhs", a, lhs), ("rhs", b, rhs)):
        if len(set(spec)) != len(spec):
            raise ValueError(f"fp8_einsum: repeated letter in {name} spec {spec!r}")
        if len(spec) != x.ndim:
            raise ValueError(f"fp8_einsum: {name} spec {spec!r} has {len(spec)} letters but "
                             f"{name} has {x.ndim} axes")
    if len(set(out)) != len(out) or not set(out) <= set(a) | set(b):
        raise ValueError(f"fp8_einsum: bad output spec {out!r}")
    # Sum away letters that appear in one operand only and not in the output.
    for side in (0, 1):
        spec, other = (a, b) if side == 0 else (b, a)
        drop = [i for i, c in enumerate(spec) if c not in other and c not in out]
        if drop:
            keep = "".join(c for i, c in enumerate(spec) if i not in drop)
            if side == 0:
                lhs, a = jnp.sum(lhs, axis=tuple(drop)), keep
            else:
                rhs, b = jnp.sum(rhs, axis=tuple(drop)), keep
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    dn = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
          (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    y, meta = fp8_dot_general(lhs, rhs, dn, meta, preferred_element_type=preferred_element_type)
    produced = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    perm = tuple(produced.index(c) for c in out)
    if perm != tuple(range(len(perm))):
        y = jnp.transpose(y, perm)
    return y, meta
