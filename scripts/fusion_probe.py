"""A/B probe: how the backward's gradient quantization fuses in a train step (H200).

XLA fused the quantize of a residual-stream gradient into LayerNorm's column-reduction
fusion, which then ran ~3x slower than the two kernels Flax's step gets. This runs the
4-block train step of bench_train_step.py with fp8_dot_general's backward as it is
("base") and with variants of it swapped in, and prints each one's device time.

    python scripts/fusion_probe.py OUTDIR [variant ...]
"""

import os
import sys

import jax
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


VARIANTS = {"base": BASE_BWD, "barrier": barrier_bwd}


def main():
    outdir = sys.argv[1]
    names = sys.argv[2:] or list(VARIANTS)
    summary = []
    for name in names:
        ops._fp8_dot_threaded.defvjp(ops._fp8_dot_fwd_rule, VARIANTS[name], symbolic_zeros=True)
        jax.clear_caches()
        data = bench_train_step.run(["--blocks", "4", "--variants", "jax_fp8,jax_fp8_noupdate",
                                     "--top-kernels", "3000", "--save-hlo",
                                     "--outdir", os.path.join(outdir, name)])
        for r in data["results"]:
            summary.append((name, r["variant"], r.get("device_ms"), r["hlo"]["kernels"]))
    ops._fp8_dot_threaded.defvjp(ops._fp8_dot_fwd_rule, BASE_BWD, symbolic_zeros=True)
    for row in summary:
        print("PROBE %-10s %-18s device %.3f ms, %d kernels" % row)


if __name__ == "__main__":
    main()
