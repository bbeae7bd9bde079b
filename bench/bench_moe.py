"""One mixture-of-experts decoder layer's MoE block, trained a step at a time: bf16 grouped GEMMs
(`jax_fp8.ragged_dot`, one grouped kernel per product on a GPU) against
`jax_fp8.fp8_ragged_dot` in each recipe, with XLA's own ``jax.lax.ragged_dot`` as a second
baseline; device time by kernel family, the GEMM floor and peak memory.

The block (as public JAX MoE code writes it, tests/moe/moe_models.py): RMS-normalised tokens,
a router GEMM [tokens, d] x [d, experts] with softmax and top-k, the tokens repeated for
their k experts and sorted by expert, the gate / up / down expert projections as three
``ragged_dot``s with SiLU between them, unsort and the routing-weighted sum. One step is
``jax.value_and_grad`` of a mean-square loss w.r.t. the input, the router and the experts'
weights and (delayed scaling) the per-expert FP8 states, followed by the fused update of
those states.

Models (``--models``):

* ``qwen3_moe``: 128 experts, top-8, d 2048, expert ffn 768, 4096 tokens (Qwen3-MoE-like);
* ``deepseek``: 256 experts, top-8, d 7168, expert ffn 2048, 4096 tokens (DeepSeek-V3-like);
* ``tiny``: 8 experts, top-2, d 64, ffn 32, 32 tokens (a CPU smoke run).

Variants (``--variants``): ``bf16`` (`jax_fp8.ragged_dot` in bfloat16, the router in bfloat16:
the baseline every ratio is against), ``bf16_xla`` (``jax.lax.ragged_dot``, which XLA:GPU
expands into a dense product over all experts: G times the FLOPs and a G-times temporary),
``delayed``, ``current``, ``block``, ``mxfp8`` (every expert projection an `fp8_ragged_dot` of
that recipe; the router stays in bfloat16).

Before it is timed, each variant's first step is checked: its loss finite and within
``CHECK_RTOL`` of the float32 reference's (`reference_loss`: the same block in float32, each
expert's rows multiplied by its weight alone, group by group: no grouped GEMM, and no
expansion over all experts, which does not fit at the models' sizes), so a kernel that
fails or computes wrong numbers gives an error in the table, never a time.

Times: on a GPU the kernels of ``--steps`` steps in a profiler trace, split by kernel family
(bench/llm_kernels.py: FP8 GEMMs, which include jax_fp8's grouped GEMM custom calls,
bf16 GEMMs, jax_fp8's other kernels, XLA fusions, ...), the device time per step, and the
floor: the GEMM families' time per step (what the step would take were everything else
free); elsewhere the median wall time of ``--steps`` steps. Each variant also reports which
lowering its grouped GEMMs got (``explain``: the grouped kernel or the reference).

Examples:
  python bench/bench_moe.py                                     # qwen3_moe and deepseek, GPU
  python bench/bench_moe.py --models tiny --steps 2 --outdir /tmp/moe   # CPU smoke

Writes ``moe.json`` and ``moe.md`` under ``--outdir``.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import common  # noqa: E402
import jax_fp8  # noqa: E402
import llm_kernels  # noqa: E402
from jax_fp8.devtools import explain, trace  # noqa: E402

MODELS = {**common.MOE_MODELS, "tiny": (8, 2, 64, 32, 32)}  # experts, top_k, d, ffn, tokens
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.Float8CurrentScaling(),
           "block": jax_fp8.Float8BlockScaling(), "mxfp8": jax_fp8.MXFP8BlockScaling()}
VARIANTS = ("bf16", "bf16_xla", *RECIPES)
# How far a variant's first loss may be from the float32 reference's (relative): bf16 and
# FP8 rounding of a mean square, far below what a wrong grouped GEMM gives.
CHECK_RTOL = {"bf16": 0.01, "bf16_xla": 0.01, "delayed": 0.1, "current": 0.1, "block": 0.1,
              "mxfp8": 0.1}
GEMM_FAMILIES = ("fp8_gemm", "bf16_gemm")


def init(model, seed=0):
    experts, _, d, ffn, tokens = MODELS[model]
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.bfloat16)

    params = {"router": w(d, experts), "gate": w(experts, d, ffn), "up": w(experts, d, ffn),
              "down": w(experts, ffn, d)}
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    return params, x


def moe_block(params, x, top_k, ragged):
    """The MoE block of one decoder layer; ``ragged(name, lhs, rhs, group_sizes)`` is the
    grouped GEMM of the projection ``name``."""
    experts = params["router"].shape[1]
    h = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
                          + 1e-6).astype(x.dtype)
    logits = jnp.dot(h, params["router"], preferred_element_type=jnp.float32)
    weights, selected = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = selected.ravel()
    order = jnp.argsort(flat)
    xs = jnp.repeat(h, top_k, axis=0)[order]
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    gate = ragged("gate", xs, params["gate"], sizes)
    up = ragged("up", xs, params["up"], sizes)
    down = ragged("down", jax.nn.silu(gate) * up, params["down"], sizes)
    out = down[jnp.argsort(order)].reshape(-1, top_k, x.shape[-1])
    return x + jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)


def _grouped_f32(_, lhs, rhs, sizes):
    """Each group's rows times its expert's weight in float32, group by group (no grouped
    GEMM, and no product over all experts: `_groups_f32`), the rows past the groups 0."""
    window = -(-max(int(np.max(np.asarray(sizes))), 1) // 256) * 256
    return _groups_f32(lhs, rhs, jnp.asarray(sizes, jnp.int32), window)


@functools.partial(jax.jit, static_argnums=3)
def _groups_f32(lhs, rhs, sizes, window):
    """One compiled loop over the groups: group g's rows (a `window`-row slice from its first
    row, the rows past its size masked to 0) times rhs[g] in float32, added into the output's
    rows from the group's first (other groups' rows get + 0). One expert's weight is cast
    to float32 at a time: a float32 copy of them all does not fit beside the bf16 ones at
    DeepSeek-V3's sizes."""
    m, n = lhs.shape[0], rhs.shape[-1]
    starts = jnp.cumsum(sizes) - sizes
    lhs = jnp.concatenate([lhs.astype(jnp.float32), jnp.zeros((window, lhs.shape[1]),
                                                              jnp.float32)])

    def group(g, out):
        rows = jax.lax.dynamic_slice_in_dim(lhs, starts[g], window)
        rows = jnp.where((jnp.arange(window) < sizes[g])[:, None], rows, 0.0)
        product = jnp.dot(rows, rhs[g].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jax.lax.dynamic_slice_in_dim(out, starts[g], window) + product, starts[g], 0)

    out = jax.lax.fori_loop(0, rhs.shape[0], group, jnp.zeros((m + window, n), jnp.float32))
    return out[:m]


def reference_loss(model, params, x):
    """The block's loss in float32, group by group (`_grouped_f32`): the numbers every
    variant's first step is checked against."""
    top_k = MODELS[model][1]
    f32 = {**params, "router": params["router"].astype(jnp.float32)}
    return float(jnp.mean(jnp.square(moe_block(f32, x.astype(jnp.float32), top_k,
                                               _grouped_f32))))


def make_step(model, variant):
    experts, top_k, *_ = MODELS[model]
    if variant in ("bf16", "bf16_xla"):
        ragged_dot = jax_fp8.ragged_dot if variant == "bf16" else jax.lax.ragged_dot

        def loss(params, fp8, x):
            del fp8
            return jnp.mean(jnp.square(moe_block(
                params, x, top_k, lambda _, a, w, s: ragged_dot(a, w, s)).astype(
                    jnp.float32)))
        fp8 = {}
    else:
        recipe = RECIPES[variant]
        fp8 = {n: jax_fp8.Fp8Meta.create(recipe, shape=(experts,))
               for n in ("gate", "up", "down")}

        def loss(params, fp8, x):
            def ragged(name, a, w, s):
                return jax_fp8.fp8_ragged_dot(a, w, s, fp8[name])[0]
            return jnp.mean(jnp.square(moe_block(params, x, top_k, ragged).astype(
                jnp.float32)))

    def step(params, fp8, x):
        value, (g_params, g_fp8, g_x) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
            params, fp8, x)
        params = jax.tree.map(lambda p, g: p - 1e-3 * g.astype(p.dtype), params, g_params)
        if variant in RECIPES:
            fp8 = jax_fp8.new_fp8_state(fp8, g_fp8, RECIPES[variant])
        return params, fp8, value, g_x

    return jax.jit(step, donate_argnums=(0, 1)), loss, fp8


def lowerings(loss, params, fp8, x):
    """How the variant's grouped GEMMs lower here, from explain's rows of the FP8 and bf16
    grouped GEMM primitives and of the grouped weight-gradient primitive (none for the
    blocked recipes): (grouped GEMMs, weight gradients)."""
    rows = explain.explain(jax.grad(loss, argnums=(0, 1, 2)), params, fp8, x)
    got = sorted({f"{r.lowering}: {r.why}" for r in rows
                  if r.name in ("jax_fp8_grouped_gemm", "jax_fp8_ragged_dot")})
    emulated = any(r.lowering == "blocks emulated" for r in rows)
    wgrad = sorted({f"{r.lowering}: {r.why}" for r in rows if r.name == "jax_fp8_grouped_wgrad"})
    return got or (["blocks emulated (float32 dequantized ragged_dot)"] if emulated else []), wgrad


def run(model, variant, steps, ref_loss):
    params, x = init(model)
    step, loss, fp8 = make_step(model, variant)
    grouped, wgrad = lowerings(loss, params, fp8, x)
    row = {"model": model, "variant": variant, "grouped_lowering": grouped,
           "wgrad_lowering": wgrad}
    compiled = step.lower(params, fp8, x).compile()
    memory = compiled.memory_analysis()
    if memory is not None:
        row["peak_gb"] = (memory.temp_size_in_bytes + memory.argument_size_in_bytes +
                          memory.output_size_in_bytes - memory.alias_size_in_bytes) / 1e9
    params, fp8, value, _ = step(params, fp8, x)
    first = float(jax.block_until_ready(value))
    row["first_loss"], row["reference_loss"] = first, ref_loss
    if not np.isfinite(first) or abs(first - ref_loss) > CHECK_RTOL[variant] * abs(ref_loss):
        raise RuntimeError(f"the first step's loss {first!r} is not within "
                           f"{CHECK_RTOL[variant]:.0%} of the float32 reference's {ref_loss!r}: "
                           f"no time is reported")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, fp8, value, _ = step(params, fp8, x)
        jax.block_until_ready(value)
        times.append((time.perf_counter() - t0) * 1e3)
    row["wall_ms"] = statistics.median(times)
    row["loss"] = float(value)
    if jax.devices()[0].platform == "gpu":
        families = llm_kernels.hlo_families(compiled)
        (params, fp8), events = trace.capture(lambda c: step(*c, x)[:2], (params, fp8),
                                              steps=steps)
        events = trace.device_events(events, platform="gpu")
        ms, _, top, _ = llm_kernels.split_by_family(events, families, steps, top=8)
        row["device_ms"] = trace.total_us(events) / steps / 1e3
        row["families_ms"] = ms
        row["floor_ms"] = sum(ms.get(f, 0.0) for f in GEMM_FAMILIES)
        row["top_kernels"] = top
    return row


def table(rows):
    lines = ["| model | variant | wall ms | device ms | GEMM floor ms | device / floor | "
             "vs bf16 (grouped kernel) | peak GB | grouped GEMMs |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {r["model"]: r for r in rows if r["variant"] == "bf16"}
    for r in rows:
        t = r.get("device_ms") or r.get("wall_ms")
        ref = base.get(r["model"])
        ref_t = ref and (ref.get("device_ms") or ref.get("wall_ms"))
        fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
        over = (r["device_ms"] / r["floor_ms"]) if r.get("floor_ms") else None
        lowering = r.get("grouped_lowering", []) + [
            f"weight gradient {w}" for w in r.get("wgrad_lowering", [])]
        lines.append(f"| {r['model']} | {r['variant']} | {fmt(r.get('wall_ms'))} | "
                     f"{fmt(r.get('device_ms'))} | {fmt(r.get('floor_ms'))} | {fmt(over)} | "
                     f"{fmt(ref_t / t if ref_t and t else None)}x | {fmt(r.get('peak_gb'))} | "
                     f"{'; '.join(lowering) or '—'} |")
    errors = [(r["model"], r["variant"], r["error"]) for r in rows if "error" in r]
    if errors:
        lines += ["", "Failed:"] + [f"- {m} {v}: {e}" for m, v, e in errors]
    return "\n".join(lines)


def main(argv=None):
    def extra(p):
        p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
        p.add_argument("--tokens", type=int, default=None,
                       help="tokens per step for every model (default: the model's)")
    args = common.moe_args(__doc__, MODELS, 10, "bench/results", argv, extra=extra)
    rows = []
    if args.tokens is not None:
        for model in args.models:
            MODELS[model] = (*MODELS[model][:4], args.tokens)
    for model in args.models:
        ref_loss = reference_loss(model, *init(model))
        for variant in args.variants:
            try:
                rows.append(run(model, variant, args.steps, ref_loss))
            except Exception as err:  # noqa: BLE001 - recorded, the table shows it
                rows.append({"model": model, "variant": variant,
                             "error": f"{type(err).__name__}: {err}"[:300]})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "top_kernels"}),
                  file=sys.stderr, flush=True)
            common.write_report(args.outdir, "moe", {"platform": jax.devices()[0].platform,
                                                     "steps": args.steps, "rows": rows},
                                table(rows), quiet=True)
    common.write_report(args.outdir, "moe", {"platform": jax.devices()[0].platform,
                                             "steps": args.steps, "rows": rows}, table(rows))


if __name__ == "__main__":
    main()
