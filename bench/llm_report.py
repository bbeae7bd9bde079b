"""Derived figures (speed-ups, floors, FP8 overhead), the markdown report and the plot of
bench_llm's results."""

from __future__ import annotations

import numpy as np

import common
from llm_kernels import FAMILIES, FAMILY_LABELS, FAMILY_NOTE, FLOOR_NOTE, GEMM_FAMILIES
from llm_models import VARIANTS

# --------------------------------------------------------------------------------------
# Derived figures, the report and the plot.
# --------------------------------------------------------------------------------------

TIMES = (("device_ms", "device"), ("pipelined_ms", "pipelined"), ("blocked_ms", "blocked"))


def _split(r):
    """(GEMM ms, attention ms, everything else ms) of a row with a family split, else None."""
    fam = r.get("families_ms")
    if not fam or r.get("device_ms") is None:
        return None
    gemm = sum(fam.get(k, 0.0) for k in GEMM_FAMILIES)
    att = fam.get("attention", 0.0)
    return gemm, att, r["device_ms"] - gemm - att


def derive(results):
    """Per size and variant: the speed-ups vs bf16 and vs Flax FP8 of every time,
    pipelined / device, and for FP8 variants the floor (FLOOR_NOTE) and the FP8 overhead."""
    out = {}
    for key, rows in common.by_group(results, "size").items():
        per = common.speedups(rows, [m for m, _ in TIMES])
        base = _split(rows.get("bf16", {}))
        for v, r in rows.items():
            e = per[v]
            split = _split(r)
            if split:
                e["gemm_ms"], e["attention_ms"], e["rest_ms"] = split
            if r.get("device_ms") and r.get("pipelined_ms"):
                e["pipelined_over_device"] = r["pipelined_ms"] / r["device_ms"]
            if v != "bf16" and split and base:
                floor = split[0] + base[1] + base[2]
                e["floor_ms"] = floor
                e["floor_vs_bf16"] = rows["bf16"]["device_ms"] / floor
                e["floor_over_device"] = floor / r["device_ms"]
                e["overhead_ms"] = split[2] - base[2]
        out[key] = per
    return out


def _f(x, spec="{:.2f}"):
    return common.fmt(x, spec)


def _gemms_table(rows):
    """Each variant's GEMMs by shape: kernels per step, ms per step, TFLOP/s."""
    key = "gemms" if any(r.get("gemms") for r in rows) else "cpu_gemms"
    rows = [r for r in rows if (r.get(key) or {}).get("rows")]
    if not rows:
        return []
    what = "GPU kernel time" if key == "gemms" else "CPU op time"
    lines = ["", f"GEMMs by shape ({what} of the kernels each GEMM of the compiled step "
                 "launches, found by the HLO op a kernel's trace event names or, where none "
                 "does (command buffers), by the program's order; B × M × N × K: `batch` "
                 "products of [M, K] × [K, N]; TFLOP/s = 2 B M N K per call / its time; "
                 "backward: under JAX's `transpose(` in the "
                 "op name; alone (--gemms-alone): the same FP8 GEMM timed on its own, with "
                 "the step's accumulation (fast in the forward, float32 in the backward) "
                 "and with the other):", "",
             "| variant | GEMM | role | B × M × N × K | per step | ms per step | TFLOP/s | "
             "alone | alone, other accumulation |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        table = r[key]
        for g in table["rows"]:
            shape = " × ".join(str(g[f]) if g[f] is not None else "?"
                               for f in ("batch", "m", "n", "k"))
            lines.append("| " + " | ".join([
                r["label"], "FP8" if g["fp8"] else "bf16", g["role"], shape,
                _f(g["per_step"], "{:g}"), _f(g["ms_per_step"], "{:.3f}"),
                _tflops(g["tflops"]), _tflops((g.get("alone") or {}).get("tflops")),
                _tflops((g.get("alone") or {}).get("tflops_other_accumulation"))]) + " |")
        if table.get("unattributed_ms"):
            lines.append(f"| {r['label']} | (kernels naming no GEMM of the program) | | | | "
                         f"{table['unattributed_ms']:.3f} | | | |")
    return lines


def _tflops(x):
    return _f(x, "{:,.0f}" if (x or 0) >= 100 else "{:.3g}")


def _pieces_table(rows, per):
    """What each layout kernel saves: the variants that hand a piece back to XLA against
    jax_fp8 delayed of the same run (``per``: `derive`'s entries of the size)."""
    ref = next((r for r in rows if r["variant"] == "jax_fp8_delayed"), None)
    pieces = [r for r in rows if VARIANTS.get(r["variant"]) and VARIANTS[r["variant"]].xla_pieces]
    if ref is None or not pieces:
        return []
    lines = ["", "Each layout kernel on and off (the same step with that piece as XLA's own "
                 "ops):", "",
             "| variant | device ms | − jax_fp8 delayed | FP8 overhead ms | "
             "quantize/transpose ms | jax_fp8 kernels ms |", "|---|---:|---:|---:|---:|---:|"]
    for r in [ref] + pieces:
        fam = r.get("families_ms") or {}
        lines.append("| " + " | ".join([
            r["label"], _f(r.get("device_ms")),
            "" if r is ref else _f(None if r.get("device_ms") is None
                                   else r["device_ms"] - ref["device_ms"], "{:+.2f}"),
            _f(per.get(r["variant"], {}).get("overhead_ms"), "{:+.2f}"),
            _f(fam.get("quantize_transpose"), "{:.3f}"),
            _f(fam.get("jax_fp8_kernels"), "{:.3f}")]) + " |")
    return lines


def markdown(data):
    meta, s = data["meta"], data["meta"]["settings"]
    env = meta.get("environment") or {}
    lines = [f"# Decoder train step — {env.get('device', '?')}", "",
             f"jax {env.get('jax_version', '?')}, flax {env.get('flax_version', '?')}, "
             f"jax_fp8 {env.get('jax_fp8_version', '?')}; git {meta.get('git_commit')}; "
             f"{meta.get('date')}. Each variant in its own process; {s['warmup']} warm-up "
             f"steps, then {s['steps']} blocked, {s['steps']} pipelined and {s['steps']} "
             f"traced steps; amax history {s['history_len']}; Llama-style decoder: LM head "
             f"{'FP8' if s['fp8_lm_head'] else 'bf16'}, blocks "
             f"{'scanned' if s['scan'] else 'unrolled'}; converted architectures: "
             f"fp8_model, min_fp8_flops {s.get('min_fp8_flops', 'auto')}"
             + (f", modules matching {s['keep_bf16']!r} kept bf16" if s.get("keep_bf16")
                else "") + ".", "",
             "device: the sum of the GPU kernel durations per step (profiler trace); "
             "pipelined: wall time per step of steps dispatched back to back; blocked: median "
             "wall time of steps each followed by block_until_ready; × > 1 is faster; compile: "
             "lower + compile in a fresh process; temp: the compiled step's temporary "
             "buffers; peak: the device's peak memory in use in the variant's process.", "",
             FLOOR_NOTE, "", FAMILY_NOTE]
    gib = 2.0 ** 30
    for key, per in data["derived"].items():
        rows = [r for r in data["results"] if r["size"] == key]
        c = rows[0]["config"]
        lines += ["", f"## {key}: d {c['d']}, {c['heads']} heads, ffn {c['ffn']}, "
                      f"{c['layers']} blocks, {c['batch']} × {c['seq']} tokens, "
                      f"vocab {c['vocab']}",
                  "", "| variant | device ms | × bf16 | × Flax FP8 | pipelined ms | × bf16 | "
                      "× Flax FP8 | pipelined / device | blocked ms | tokens/s | compile s | "
                      "temp GiB | peak GiB |", "|---|" + "---:|" * 12]
        for r in rows:
            e = per.get(r["variant"], {})
            temp, peak = r.get("temp_bytes"), r.get("peak_bytes")
            lines.append("| " + " | ".join([
                r["label"], _f(r.get("device_ms")), _f(e.get("device_ms:vs_bf16"), "{:.3f}"),
                _f(e.get("device_ms:vs_flax"), "{:.3f}"), _f(r.get("pipelined_ms")),
                _f(e.get("pipelined_ms:vs_bf16"), "{:.3f}"),
                _f(e.get("pipelined_ms:vs_flax"), "{:.3f}"),
                _f(e.get("pipelined_over_device"), "{:.3f}"), _f(r.get("blocked_ms")),
                _f(r.get("tokens_per_s"), "{:,.0f}"), _f(r.get("lower_compile_s"), "{:.1f}"),
                _f(None if temp is None else temp / gib),
                _f(None if peak is None else peak / gib)]) + " |")
        fam_rows = [r for r in rows if r.get("families_ms")]
        if fam_rows:
            lines += ["", "Device ms per step by kernel family:", "",
                      "| variant | " + " | ".join(FAMILY_LABELS[f] for f in FAMILIES)
                      + " | total |",
                      "|---|" + "---:|" * (len(FAMILIES) + 1)]
            for r in fam_rows:
                lines.append(f"| {r['label']} | " + " | ".join(
                    _f(r["families_ms"].get(f), "{:.3f}") for f in FAMILIES)
                    + f" | {_f(r['device_ms'], '{:.3f}')} |")
            lines += ["", "| variant | GEMM ms | attention ms | rest ms | floor ms | "
                          "floor × bf16 | floor / device | FP8 overhead ms | model TFLOP/s |",
                      "|---|" + "---:|" * 8]
            for r in fam_rows:
                e = per.get(r["variant"], {})
                lines.append("| " + " | ".join([
                    r["label"], _f(e.get("gemm_ms"), "{:.3f}"), _f(e.get("attention_ms"), "{:.3f}"),
                    _f(e.get("rest_ms"), "{:.3f}"), _f(e.get("floor_ms"), "{:.3f}"),
                    _f(e.get("floor_vs_bf16"), "{:.3f}"), _f(e.get("floor_over_device"), "{:.3f}"),
                    _f(e.get("overhead_ms"), "{:+.3f}"),
                    _f(r.get("model_tflops_device"), "{:.0f}")]) + " |")
            bw_rows = [r for r in fam_rows if r.get("families_bandwidth")]
            bw_fams = [f for f in FAMILIES
                       if any(f in r["families_bandwidth"] for r in bw_rows)]
            if bw_rows:
                lines += ["", "Memory bandwidth of XLA's own kernels (fusions, copies) by "
                              "family: TB/s = bytes of each kernel's operands and result / its "
                              "time (the share of the family's time they are):", "",
                          "| variant | " + " | ".join(FAMILY_LABELS[f] for f in bw_fams) + " |",
                          "|---|" + "---:|" * len(bw_fams)]
                for r in bw_rows:
                    bw = r["families_bandwidth"]
                    lines.append(f"| {r['label']} | " + " | ".join(
                        f"{bw[f]['tb_per_s']:.2f} ({100 * bw[f]['of_time']:.0f} %)"
                        if f in bw else "—" for f in bw_fams) + " |")
        else:
            notes = {r.get("device_time_note") for r in rows} - {None}
            lines += ["", "Device time: unavailable (" + "; ".join(sorted(notes)) + ")."]
        lines += _gemms_table(rows)
        lines += _pieces_table(rows, per)
        for r in rows:
            if r.get("check_error"):
                lines.append(f"\nCHECK FAILED {key} {r['variant']}: {r['check_error']}")
    lines += common.skipped_and_failed(data, "size")
    lines += ["", common.command_line(meta)]
    return "\n".join(lines)


FAMILY_COLORS = {"fp8_gemm": "#1f77b4", "bf16_gemm": "#aec7e8", "attention": "#2ca02c",
                 "norm_quantize": "#d62728", "act_quantize": "#e377c2",
                 "quantize_transpose": "#ff7f0e", "amax": "#ffbb78",
                 "jax_fp8_kernels": "#9467bd", "optimizer": "#bcbd22", "other": "#7f7f7f"}


def plot(data, png):
    """Device time by family per variant, one panel per size (on CPU: pipelined wall time)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = common.by_group(data["results"], "size")
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(1.0 + 1.3 * max(map(len, groups.values()))
                                                      * len(groups), 4.2), squeeze=False)
    for ax, (key, rows) in zip(axes[0], groups.items()):
        names = list(rows)
        x = np.arange(len(names))
        if all(r.get("families_ms") for r in rows.values()):
            bottom = np.zeros(len(names))
            for f in FAMILIES:
                vals = np.array([rows[n]["families_ms"].get(f, 0.0) for n in names])
                ax.bar(x, vals, 0.7, bottom=bottom, color=FAMILY_COLORS[f], label=FAMILY_LABELS[f])
                bottom += vals
            for n, xi, top in zip(names, x, bottom):
                e = data["derived"][key].get(n, {})
                if e.get("floor_ms"):
                    ax.plot([xi - 0.35, xi + 0.35], [e["floor_ms"]] * 2, "k--", linewidth=1)
                if e.get("device_ms:vs_bf16"):
                    ax.text(xi, top, f"{e['device_ms:vs_bf16']:.2f}×", ha="center", va="bottom",
                            fontsize=8)
            ax.set_ylabel("device ms per step (dashed: floor)")
        else:
            ax.bar(x, [rows[n].get("pipelined_ms") or 0.0 for n in names], 0.7, color="#7f7f7f")
            ax.set_ylabel("pipelined wall ms per step (no device time)")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.set_title(key)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=8)
        fig.tight_layout(rect=(0, 0, 1, 0.86))
    else:
        fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True
