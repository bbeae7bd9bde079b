"""The grouped GEMMs of mixture-of-experts layers, shape by shape, in one run, in TFLOP/s:
jax_fp8's grouped FP8 kernels (CUTLASS SM90 ptr-array grouped GEMMs: ``grouped_gemm`` for the
forward and data-gradient products, ``grouped_wgrad`` for the weight gradient, ragged along
its contraction), jax_fp8's bf16 grouped kernel (`jax_fp8.ragged_dot`'s primitive, the same
CUTLASS family in bfloat16: the baseline), XLA's own ``jax.lax.ragged_dot`` /
``ragged_dot_general`` in bfloat16 (which XLA:GPU expands into a dense product over all
experts), the FP8 primitives' jax.numpy references, and a dense per-tensor FP8 GEMM of the
same (M, K, N) (XLA's cuBLASLt FP8 GEMM through ``jax_fp8.gemm._gemms.gemm``, fast accumulation
and float32 accumulation).

Shapes (``--models``): the expert GEMMs of one MoE layer over ``tokens x top_k`` routed rows,
tokens sorted by expert, group sizes drawn once per model (seed 0) from a multinomial over
Dirichlet(5) expert weights (a mildly unbalanced router; the table gives the smallest and
largest group):

* ``qwen3_moe``: 128 experts, d 2048, expert ffn 768, 4096 x 8 routed rows (Qwen3-MoE-like);
* ``deepseek``: 256 experts, d 7168, expert ffn 2048, 4096 x 8 routed rows (DeepSeek-V3-like);
* ``tiny``: 4 experts, d 64, ffn 32, 16 x 2 rows (a CPU smoke run).

Per model, six GEMMs, bf16 out: the fused gate/up projection forward (E4M3 [rows, d] x
[G, 2 ffn, d]), the down projection forward (E4M3 [rows, ffn] x [G, d, ffn]), their data
gradients (E5M2 gradient x E4M3 transposed weights), and their weight gradients (E4M3 input
[rows, K] and E5M2 gradient [rows, N] -> [G, K, N], each group's tokens the contraction).
The bf16 columns run the same values in bfloat16 (every FP8 value is exact in bfloat16).

Times: the GPU kernels' durations in a profiler trace of ``--steps`` calls (``device_us``,
everything the jitted call runs: the weight gradient's transposes into padded columns
included), and the median wall time of ``--steps`` calls (``wall_us``; the only time on CPU).
FLOPs: 2 x rows x N x K (the rows the groups cover). ``rel_diff``: max |out - bf16 grouped|
/ max |bf16 grouped| of each other path against the bf16 grouped kernel's (or, where it
failed, XLA's) result of the same values, a sanity check (tests/kernels/ hold the error
bounds); a kernel path whose result is further than ``CHECK_REL`` from it, or whose program
does not contain its kernel, reports an error, never a time. A path that fails (e.g. out of
memory) is recorded with its error.

Examples:
  python bench/bench_grouped_gemm.py                        # qwen3_moe and deepseek, GPU
  python bench/bench_grouped_gemm.py --models tiny --steps 2 --outdir /tmp/gg   # CPU smoke

Writes ``grouped_gemm.json`` and ``grouped_gemm.md`` under ``--outdir``.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import common  # noqa: E402
from jax_fp8._primitives import (
    grouped_gemm as gg,  # noqa: E402
    grouped_wgrad as gw,  # noqa: E402
    ragged_dot as rd,  # noqa: E402
)
from jax_fp8.devtools import trace  # noqa: E402
from jax_fp8.gemm import _gemms  # noqa: E402

MODELS = {**common.MOE_MODELS, "tiny": (4, 2, 64, 32, 16)}  # experts, top_k, d, ffn, tokens
NT = (((1,), (1,)), ((), ()))
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
COLUMNS = ("fp8_grouped", "bf16_grouped", "bf16_xla", "reference", "dense_fp8_fast",
           "dense_fp8_f32acc")
# The largest max |out - bf16 grouped| / max |bf16 grouped| a kernel path may show: the FP8
# products are exact in float32 and both sum in float32, so only summation order and the one
# bf16 rounding differ (a wrong group or a missing tile gives O(1)).
CHECK_REL = 1e-2
FWD, DGRAD, WGRAD = "fwd", "dgrad", "wgrad"


def model_gemms(model):
    """[(name, kind, lhs dtype, rhs dtype, K, N)] of one MoE layer's expert GEMMs."""
    _, _, d, ffn, _ = MODELS[model]
    return [("gate_up fwd", FWD, E4M3, E4M3, d, 2 * ffn), ("down fwd", FWD, E4M3, E4M3, ffn, d),
            ("gate_up dgrad", DGRAD, E5M2, E4M3, 2 * ffn, d),
            ("down dgrad", DGRAD, E5M2, E4M3, d, ffn),
            ("gate_up wgrad", WGRAD, E4M3, E5M2, d, 2 * ffn),
            ("down wgrad", WGRAD, E4M3, E5M2, ffn, d)]


def group_sizes(model):
    experts, top_k, _, _, tokens = MODELS[model]
    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.full(experts, 5.0))
    return rng.multinomial(tokens * top_k, weights).astype(np.int32)


def fp8(rng, shape, dtype):
    """Random FP8 values of unit scale (normal, times 16): every byte drawn on the host
    and moved once."""
    return jax.device_put((rng.standard_normal(shape) * 16).astype(np.dtype(dtype)))


def device_us(fn, args, steps):
    """GPU kernel time of one call from a profiler trace of `steps` calls (None on CPU)."""
    if jax.devices()[0].platform != "gpu":
        return None
    out = fn(*args)
    jax.block_until_ready(out)
    _, events = trace.capture(lambda c: (c[0], fn(*c[0])), (args, out), steps=steps)
    events = trace.device_events(events, platform="gpu")
    return trace.total_us(events) / steps


def wall_us(fn, args, steps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


@functools.cache
def grouped(implementation):
    return jax.jit(lambda *a: gg.grouped_gemm(*a, out_dtype=jnp.bfloat16,
                                              implementation=implementation))


@functools.cache
def wgrad(implementation):
    return jax.jit(lambda *a: gw.grouped_wgrad(*a, out_dtype=jnp.bfloat16,
                                               implementation=implementation))


@functools.cache
def bf16_grouped(mode):
    return jax.jit(lambda *a: rd.ragged_product(*a, mode=mode, out_dtype=jnp.bfloat16))


@jax.jit
def bf16_xla(lhs, rhs_kn, sizes):
    return jax.lax.ragged_dot(lhs, rhs_kn, sizes, preferred_element_type=jnp.bfloat16)


@jax.jit
def bf16_xla_wgrad(lhs, grad, sizes):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=())
    return jax.lax.ragged_dot_general(lhs, grad, sizes, numbers,
                                      preferred_element_type=jnp.bfloat16)


@functools.cache
def dense(precision):
    one = jnp.float32(1)
    return jax.jit(lambda a, b: _gemms.gemm(a, b, NT, one, one, jnp.bfloat16,
                                            precision=precision))


def call_plans(kind, lhs, rhs, sizes, scale, dense_rhs):
    """{column: () -> (jitted function, its arguments, the custom call it must contain)} for
    one grouped GEMM: lhs [M, K]; rhs the weights [G, N, K] (fwd, dgrad) or the gradient
    [M, N] (wgrad)."""
    bf16 = jnp.bfloat16
    if kind == WGRAD:
        fp8 = {"fp8_grouped": lambda: (wgrad("cuda"), (lhs, rhs, sizes, scale, scale), gw.TARGET),
               "bf16_grouped": lambda: (bf16_grouped(rd.WEIGHT_GRAD), (
                   lhs.astype(bf16), rhs.astype(bf16), sizes), rd.TARGET),
               "bf16_xla": lambda: (bf16_xla_wgrad, (lhs.astype(bf16), rhs.astype(bf16),
                                                     sizes), None),
               "reference": lambda: (wgrad("jnp"), (lhs, rhs, sizes, scale, scale), None)}
    else:
        # The forward product reads the weights [G, K, N] as a model stores them; the data
        # gradient reads them transposed ([G, N, K]) as the backward pass does.
        bf16_plan = ((bf16_grouped(rd.FORWARD), (lhs.astype(bf16), jnp.swapaxes(
            rhs, 1, 2).astype(bf16), sizes)) if kind == FWD else
                     (bf16_grouped(rd.TRANSPOSED), (lhs.astype(bf16), rhs.astype(bf16), sizes)))
        fp8 = {"fp8_grouped": lambda: (grouped("cuda"), (lhs, rhs, sizes, scale, scale),
                                       gg.TARGET),
               "bf16_grouped": lambda: (*bf16_plan, rd.TARGET),
               "bf16_xla": lambda: (bf16_xla, (lhs.astype(bf16), jnp.swapaxes(
                   rhs, 1, 2).astype(bf16), sizes), None),
               "reference": lambda: (grouped("jnp"), (lhs, rhs, sizes, scale, scale), None)}
    # The bf16 grouped kernel first: every other result is checked against its.
    return {**{c: fp8[c] for c in ("bf16_grouped", "bf16_xla", "fp8_grouped", "reference")},
            "dense_fp8_fast": lambda: (dense(None), (lhs, dense_rhs), None),
            "dense_fp8_f32acc": lambda: (dense(jax.lax.Precision.HIGHEST), (lhs, dense_rhs),
                                         None)}


def measure(models, steps, columns=COLUMNS, report=None):
    """The rows of the table, `columns` of each; ``report(rows)`` after each row (so a run
    cut short keeps what it measured)."""
    rows = []
    on_gpu = jax.devices()[0].platform == "gpu"
    for model in models:
        sizes = group_sizes(model)
        experts = len(sizes)
        rng = np.random.default_rng(1)
        m = int(sizes.sum())
        for name, kind, lhs_dtype, rhs_dtype, k, n in model_gemms(model):
            row = {"model": model, "gemm": name, "groups": experts, "rows": m, "n": n, "k": k,
                   "lhs": np.dtype(lhs_dtype).name, "rhs": np.dtype(rhs_dtype).name,
                   "min_group": int(sizes.min()), "max_group": int(sizes.max()),
                   "tflops": {}, "device_us": {}, "wall_us": {}, "rel_diff": {}, "errors": {}}
            flops = 2.0 * m * n * k
            lhs = fp8(rng, (m, k), lhs_dtype)
            rhs = fp8(rng, (m, n) if kind == WGRAD else (experts, n, k), rhs_dtype)
            dense_rhs = fp8(rng, (n, k), E4M3)
            ones = jnp.ones((experts,), jnp.float32)
            sizes_d = jax.device_put(sizes)
            want = None
            plans = call_plans(kind, lhs, rhs, sizes_d, ones, dense_rhs)
            for column, plan in ((c, p) for c, p in plans.items() if c in columns):
                try:
                    fn, args, target = plan()
                    jax.block_until_ready(args)
                    if target is not None and on_gpu:
                        if target not in fn.lower(*args).compile().as_text():
                            status = (gw if target == gw.TARGET else
                                      rd if target == rd.TARGET else gg).kernel_status()
                            raise RuntimeError(f"no {target} custom call: {status}")
                    out = fn(*args)
                    if column in ("bf16_grouped", "bf16_xla") and want is None:
                        want = np.asarray(out, np.float32)
                        row["checked_against"] = column
                    elif want is not None and not column.startswith("dense"):
                        scale = float(np.abs(want).max()) or 1.0
                        diff = float(np.abs(np.asarray(out, np.float32) - want).max()) / scale
                        row["rel_diff"][column] = diff
                        if target is not None and not diff <= CHECK_REL:
                            raise RuntimeError(f"result differs from {row['checked_against']}'s "
                                               f"by {diff:.3g} (relative): no time reported")
                    del out
                    row["wall_us"][column] = wall_us(fn, args, steps)
                    row["device_us"][column] = device_us(fn, args, steps)
                    us = row["device_us"][column] or row["wall_us"][column]
                    row["tflops"][column] = flops / us / 1e6
                except Exception as err:  # noqa: BLE001 - recorded, the table shows it
                    row["errors"][column] = f"{type(err).__name__}: {err}"[:300]
            rows.append(row)
            print(f"{model:9s} {name:13s} G={experts} rows={m} n={n} k={k} "
                  + " ".join(f"{c}={v:.1f}" for c, v in row["tflops"].items()), flush=True)
            del lhs, rhs, dense_rhs, want, plans
            if report is not None:
                report(rows)
    return rows


def table(rows):
    head = ("| model | GEMM | G | rows (min..max group) | N | K | "
            + " | ".join(COLUMNS) + " | FP8 grouped / bf16 grouped | FP8 grouped / dense FP8 | "
            "rel. diff FP8 grouped |")
    lines = ["TFLOP/s (device time where a GPU trace has it, else wall time)", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["tflops"]
        cells = [f"{t[c]:.1f}" if c in t else "—" for c in COLUMNS]
        ratio = (f"{t['fp8_grouped'] / t['bf16_grouped']:.2f}x"
                 if "fp8_grouped" in t and "bf16_grouped" in t else "—")
        of_dense = (f"{t['fp8_grouped'] / t['dense_fp8_fast']:.2f}"
                    if "fp8_grouped" in t and "dense_fp8_fast" in t else "—")
        diff = r["rel_diff"].get("fp8_grouped")
        lines.append(f"| {r['model']} | {r['gemm']} | {r['groups']} | {r['rows']} "
                     f"({r['min_group']}..{r['max_group']}) | {r['n']} | {r['k']} | "
                     + " | ".join(cells) + f" | {ratio} | {of_dense} | "
                     + ("—" if diff is None else f"{diff:.2e}") + " |")
    errors = [(r["model"], r["gemm"], c, e) for r in rows for c, e in r["errors"].items()]
    if errors:
        lines += ["", "Failed or fell back (— above):"]
        lines += [f"- {m} {g} {c}: {e}" for m, g, c, e in errors]
    return "\n".join(lines) + "\n"


def main(argv=None):
    def extra(p):
        p.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=COLUMNS,
                       help="the paths to measure (default: all; bf16_grouped is what the "
                            "others are checked against)")
    args = common.moe_args(__doc__, MODELS, 20, "bench/results/grouped_gemm", argv, extra=extra)
    for label, module in (("grouped GEMM", gg), ("grouped wgrad", gw), ("bf16 grouped", rd)):
        print(f"{label} kernel:", module.kernel_status(), flush=True)
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "steps": args.steps, "kernel_status": {"grouped_gemm": gg.kernel_status(),
                                                   "grouped_wgrad": gw.kernel_status(),
                                                   "ragged_dot": rd.kernel_status()},
            "kernel_configs": {"grouped_gemm": gg.kernel_configs(),
                               "grouped_wgrad": gw.kernel_configs(),
                               "ragged_dot": rd.kernel_configs()},
            "command": "python bench/bench_grouped_gemm.py " + " ".join(argv or sys.argv[1:])}

    def report(rows):
        common.write_report(args.outdir, "grouped_gemm", {"meta": meta, "rows": rows},
                            table(rows), quiet=True)

    rows = measure(args.models, args.steps, args.columns, report)
    common.write_report(args.outdir, "grouped_gemm", {"meta": meta, "rows": rows}, table(rows))


if __name__ == "__main__":
    main()
