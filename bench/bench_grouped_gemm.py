"""Grouped FP8 GEMMs of mixture-of-experts layers, shape by shape, in one run: jax_fp8's
grouped FP8 kernel (CUTLASS SM90 ptr-array grouped GEMM, ``implementation="cuda"``), bf16
``jax.lax.ragged_dot``, the primitive's jax.numpy reference (``implementation="jnp"``) and a
dense per-tensor FP8 GEMM of the same FLOPs (XLA's cuBLASLt FP8 GEMM through
``jax_fp8._gemms.gemm``, fast accumulation and float32 accumulation), in TFLOP/s.

Shapes (``--models``): the expert GEMMs of one MoE layer over ``tokens x top_k`` routed rows,
tokens sorted by expert, group sizes drawn once per model (seed 0) from a multinomial over
Dirichlet(5) expert weights (a mildly unbalanced router; the table gives the smallest and
largest group):

* ``qwen3_moe``: 128 experts, d 2048, expert ffn 768, 4096 x 8 routed rows (Qwen3-MoE-like);
* ``deepseek``: 256 experts, d 7168, expert ffn 2048, 4096 x 8 routed rows (DeepSeek-V3-like);
* ``tiny``: 4 experts, d 64, ffn 32, 16 x 2 rows (a CPU smoke run).

Per model, four GEMMs: the fused gate/up projection forward (E4M3 [rows, d] x [G, 2 ffn, d]),
the down projection forward (E4M3 [rows, ffn] x [G, d, ffn]) and their data gradients (E5M2
gradient x E4M3 transposed weights), bf16 out. The weight gradients (ragged along the
contraction) are not here: the grouped kernel does not compute them.

Times: the GPU kernels' durations in a profiler trace of ``--steps`` calls (``device_us``),
and the median wall time of ``--steps`` calls (``wall_us``; the only time on CPU). FLOPs:
2 x rows x N x K (the rows the groups cover). ``rel_diff``: max |out - ragged_dot| / max
|ragged_dot| of each FP8 path against bf16 ragged_dot of the same FP8 values (exact in
bf16), a sanity check (tests/kernels/test_grouped_gemm.py holds the error bound). A path
that fails (e.g. out of memory) is recorded with its error.

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
from jax_fp8 import _gemms  # noqa: E402
from jax_fp8._primitives import grouped_gemm as gg  # noqa: E402
from jax_fp8.devtools import trace  # noqa: E402

MODELS = {**common.MOE_MODELS, "tiny": (4, 2, 64, 32, 16)}  # experts, top_k, d, ffn, tokens
NT = (((1,), (1,)), ((), ()))
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
COLUMNS = ("fp8_grouped", "bf16_ragged_dot", "reference", "dense_fp8_fast", "dense_fp8_f32acc")


def model_gemms(model):
    """[(name, lhs dtype, K, N)] of one MoE layer's expert GEMMs (forward and data gradient)."""
    _, _, d, ffn, _ = MODELS[model]
    return [("gate_up fwd", E4M3, d, 2 * ffn), ("down fwd", E4M3, ffn, d),
            ("gate_up dgrad", E5M2, 2 * ffn, d), ("down dgrad", E5M2, d, ffn)]


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


@jax.jit
def bf16_ragged_dot(lhs, rhs_kn, sizes):
    return jax.lax.ragged_dot(lhs, rhs_kn, sizes, preferred_element_type=jnp.bfloat16)


@functools.cache
def dense(precision):
    one = jnp.float32(1)
    return jax.jit(lambda a, b: _gemms.gemm(a, b, NT, one, one, jnp.bfloat16,
                                            precision=precision))


def call_plans(lhs, rhs, sizes, scale):
    """{column: () -> (jitted function, its arguments)} for one grouped GEMM."""
    return {
        "bf16_ragged_dot": lambda: (bf16_ragged_dot, (
            lhs.astype(jnp.bfloat16), jnp.swapaxes(rhs, 1, 2).astype(jnp.bfloat16), sizes)),
        "fp8_grouped": lambda: (grouped("cuda"), (lhs, rhs, sizes, scale, scale)),
        "reference": lambda: (grouped("jnp"), (lhs, rhs, sizes, scale, scale)),
        "dense_fp8_fast": lambda: (dense(None), (lhs, rhs[0])),
        "dense_fp8_f32acc": lambda: (dense(jax.lax.Precision.HIGHEST), (lhs, rhs[0])),
    }


def measure(models, steps):
    rows = []
    for model in models:
        sizes = group_sizes(model)
        experts = len(sizes)
        rng = np.random.default_rng(1)
        m = int(sizes.sum())
        for name, lhs_dtype, k, n in model_gemms(model):
            row = {"model": model, "gemm": name, "groups": experts, "rows": m, "n": n, "k": k,
                   "lhs": np.dtype(lhs_dtype).name, "min_group": int(sizes.min()),
                   "max_group": int(sizes.max()), "tflops": {}, "device_us": {},
                   "wall_us": {}, "rel_diff": {}, "errors": {}}
            flops = 2.0 * m * n * k
            lhs, rhs = fp8(rng, (m, k), lhs_dtype), fp8(rng, (experts, n, k), E4M3)
            ones = jnp.ones((experts,), jnp.float32)
            sizes_d = jax.device_put(sizes)
            want = None
            plans = call_plans(lhs, rhs, sizes_d, ones)
            for column, plan in plans.items():
                try:
                    fn, args = plan()
                    jax.block_until_ready(args)
                    if column == "fp8_grouped":
                        hlo = fn.lower(*args).compile().as_text()
                        row["kernel"] = gg.TARGET in hlo
                        if not row["kernel"]:
                            row["errors"][column] = ("no custom call: " + str(gg.kernel_status()))
                    out = fn(*args)
                    if column == "bf16_ragged_dot":
                        want = np.asarray(out, np.float32)
                    elif want is not None and not column.startswith("dense"):
                        scale = float(np.abs(want).max()) or 1.0
                        row["rel_diff"][column] = float(
                            np.abs(np.asarray(out, np.float32) - want).max()) / scale
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
            del lhs, rhs, want, plans
    return rows


def table(rows):
    head = ("| model | GEMM | G | rows (min..max group) | N | K | "
            + " | ".join(COLUMNS) + " | FP8 grouped / bf16 | rel. diff FP8 grouped |")
    lines = ["TFLOP/s (device time where a GPU trace has it, else wall time)", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["tflops"]
        cells = [f"{t[c]:.1f}" if c in t else "—" for c in COLUMNS]
        ratio = (f"{t['fp8_grouped'] / t['bf16_ragged_dot']:.2f}x"
                 if "fp8_grouped" in t and "bf16_ragged_dot" in t else "—")
        diff = r["rel_diff"].get("fp8_grouped")
        lines.append(f"| {r['model']} | {r['gemm']} | {r['groups']} | {r['rows']} "
                     f"({r['min_group']}..{r['max_group']}) | {r['n']} | {r['k']} | "
                     + " | ".join(cells) + f" | {ratio} | "
                     + ("—" if diff is None else f"{diff:.2e}") + " |")
    errors = [(r["model"], r["gemm"], c, e) for r in rows for c, e in r["errors"].items()]
    if errors:
        lines += ["", "Failed or fell back (— above):"]
        lines += [f"- {m} {g} {c}: {e}" for m, g, c, e in errors]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = common.moe_args(__doc__, MODELS, 20, "bench/results/grouped_gemm", argv)
    print("grouped GEMM kernel:", gg.kernel_status(), flush=True)
    rows = measure(args.models, args.steps)
    meta = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "steps": args.steps, "kernel_status": gg.kernel_status(),
            "kernel_configs": gg.kernel_configs(),
            "command": "python bench/bench_grouped_gemm.py " + " ".join(argv or sys.argv[1:])}
    common.write_report(args.outdir, "grouped_gemm", {"meta": meta, "rows": rows}, table(rows))


if __name__ == "__main__":
    main()
