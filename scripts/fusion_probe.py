"""A/B probe: where XLA fuses fp8_dot_general's quantization and amaxes in a train step.

Runs the train step of bench_train_step.py (4 blocks, or PROBE_BLOCKS) with
fp8_dot_general's forward/backward rules as they are ("base") and with variants swapped
in, and prints each one's device time as it finishes (results and HLO per variant under
OUTDIR). Variants:
- optimization barriers that decide where an amax is taken (in the forward pass beside
  the quantization, or wherever XLA likes), and one on the incoming gradient;
- the backward without jax_fp8's CUDA kernels (`xla_transpose`,
  `no_quantize_transpose`), to measure what each kernel saves;
- `gemm_operand_scales`, a different dequantization of the FP8 GEMMs.
The FP8 values are the same in every variant; XLA's fusion and scheduling change (and,
for `gemm_operand_scales`, the GEMMs' rounding). Results so far: docs/benchmarks.md
(train-step section).

    [PROBE_BLOCKS=24] [PROBE_VARIANTS=jax_fp8] python scripts/fusion_probe.py OUTDIR [variant ...]
"""

import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
import bench_train_step  # noqa: E402

from jax_fp8 import ops  # noqa: E402

BASE_BWD = ops._fp8_dot_bwd


def barrier_bwd(dimension_numbers, out_dtype, lhs_dtype, rhs_dtype, res, cts):
    g, ct_meta = cts
    if not isinstance(g, ops.SymbolicZero):
        g = lax.optimization_barrier(g)
    return BASE_BWD(dimension_numbers, out_dtype, lhs_dtype, rhs_dtype, res, (g, ct_meta))


BASE_FWD = ops._fp8_dot_fwd


# The forward rule's residual, by name (ops._fp8_dot_fwd's order).
_RES_FIELDS = ("lhs_res", "q_rhs", "meta", "amax_lhs", "amax_rhs", "lhs_like", "rhs_like")


def tied_fwd(*names):
    """A forward rule like ops._fp8_dot_fwd with the named values ("out" or residual
    fields) passed through ONE optimization barrier together: each is then available
    only once all are computed, which pins where XLA may take an amax."""
    def fwd(lhs, rhs, meta, dimension_numbers, out_dtype):
        (out, meta_out), res = BASE_FWD(lhs, rhs, meta, dimension_numbers, out_dtype)
        values = dict(zip(_RES_FIELDS, res), out=out)
        values.update(zip(names, lax.optimization_barrier(tuple(values[n] for n in names))))
        return (values["out"], meta_out), tuple(values[n] for n in _RES_FIELDS)
    return fwd


def traced_with(target, name, value):
    """rule -> the same rule traced with `target.name` replaced by `value` (a seam of
    ops or jax_fp8._transpose)."""
    def wrap(rule):
        def traced(*args):
            with mock.patch.object(target, name, value):
                return rule(*args)
        return traced
    return wrap


def _input_amax_tied_to_gemm_operand(lhs, rhs, meta, base=ops._quantized_operands):
    """The input's amax tied to the quantized input that the forward GEMM reads: the
    amax is taken before the GEMM, where XLA can fuse it with that quantization (it
    reads the same values), and the GEMM's output is left alone (the barrier of
    input_amax_out_barrier stands between the GEMM and its bias/consumers)."""
    q_lhs, q_rhs, amax_lhs, amax_rhs = base(lhs, rhs, meta)
    q_lhs, amax_lhs = lax.optimization_barrier((q_lhs, amax_lhs))
    return q_lhs, q_rhs, amax_lhs, amax_rhs


def _gemm_dequantizing_operands(q_a, q_b, dimension_numbers, scale_inv_a, scale_inv_b,
                                out_dtype, precision=None, out_sharding=None):
    """Each FP8 operand dequantized by its own scale_inv (float32), then the dot."""
    def widen(q, s):
        return q.astype(jnp.float32) * jnp.asarray(s, jnp.float32)
    return lax.dot_general(widen(q_a, scale_inv_a), widen(q_b, scale_inv_b),
                           dimension_numbers, precision=precision,
                           preferred_element_type=out_dtype, out_sharding=out_sharding)


def _xla_rotate_axes(x, k):
    """lax.transpose instead of jax_fp8's byte-transpose kernel."""
    return lax.transpose(x, tuple(range(k, x.ndim)) + tuple(range(k)))


operand_dequant = traced_with(ops, "_fp8_gemm", _gemm_dequantizing_operands)
xla_transposes = traced_with(ops._transpose, "rotate_axes", _xla_rotate_axes)
# The gradient quantized, its amax taken and transposed by XLA (three kernels) instead
# of jax_fp8's one quantize + transpose + amax kernel.
no_quantize_transpose = traced_with(ops._transpose, "quantize_rotate_applies",
                                    lambda *a: False)


VARIANTS = {
    "base": (BASE_FWD, BASE_BWD),
    "barrier": (BASE_FWD, barrier_bwd),
    # The forward's amaxes tied to the quantized residuals: computed in the forward pass
    # beside the quantization that reads the same values.
    "amax_fwd_barrier": (tied_fwd("lhs_res", "q_rhs", "amax_lhs", "amax_rhs"), BASE_BWD),
    # Only the kernel's amax, tied to its quantized copy (XLA otherwise fuses max|w| into
    # adam's update of w; on the H200 this tie changed no fusion).
    "weight_amax_fwd_barrier": (tied_fwd("q_rhs", "amax_rhs"), BASE_BWD),
    # The kernel's amax tied to the GEMM's output, which everything downstream reads: it
    # must be taken in the forward pass, so not inside adam.
    "weight_amax_out_barrier": (tied_fwd("out", "amax_rhs"), BASE_BWD),
    # The input's amax tied to the GEMM's output. XLA otherwise takes the GELU output's
    # amax late, fused into the GELU's backward, which then is a reduction fusion and
    # can no longer take in the gradient's own E5M2 cast and amax.
    "input_amax_out_barrier": (tied_fwd("out", "amax_lhs"), BASE_BWD),
    "input_amax_gemm_barrier": (
        traced_with(ops, "_quantized_operands", _input_amax_tied_to_gemm_operand)(BASE_FWD),
        BASE_BWD),
    # Each FP8 operand dequantized by its own scale_inv (in float32) instead of the GEMM
    # result by their product: XLA then hands cuBLASLt the two scale_invs as they are,
    # where the product costs a one-element kernel per GEMM.
    # (On the H200: XLA then has cuBLASLt write float32 and converts in a kernel of its
    # own, 6.8 ms slower per 24-block step.)
    "gemm_operand_scales": (operand_dequant(BASE_FWD), operand_dequant(BASE_BWD)),
    "xla_transpose": (xla_transposes(BASE_FWD), xla_transposes(BASE_BWD)),
    "no_quantize_transpose": (BASE_FWD, no_quantize_transpose(BASE_BWD)),
}


def main():
    outdir = sys.argv[1]
    names = sys.argv[2:] or list(VARIANTS)
    for name in names:
        fwd, bwd = VARIANTS[name]
        ops._fp8_dot_threaded.defvjp(ops._fwd_rule(fwd), bwd, symbolic_zeros=True)
        jax.clear_caches()
        data = bench_train_step.run(["--blocks", os.environ.get("PROBE_BLOCKS", "4"), "--variants",
                                     os.environ.get("PROBE_VARIANTS", "jax_fp8,jax_fp8_noupdate"),
                                     "--top-kernels", "3000", "--save-hlo",
                                     "--outdir", os.path.join(outdir, name)])
        for r in data["results"]:  # printed as each finishes: a cut-off run keeps them
            print("PROBE %-10s %-18s device %.3f ms, %d kernels"
                  % (name, r["variant"], r.get("device_ms") or float("nan"), r["hlo"]["kernels"]), flush=True)
    ops._fp8_dot_threaded.defvjp(ops._fp8_dot_fwd_rule, BASE_BWD, symbolic_zeros=True)


if __name__ == "__main__":
    main()
