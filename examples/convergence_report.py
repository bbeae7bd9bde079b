"""The convergence study's results: per-run files, statistics over seeds, Markdown tables, plots and
the docs block (examples/convergence.py)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np
import scipy.stats

from convergence_setup import RUNS, Config, log

REFERENCE = "bf16"
DOC_BEGIN = "<!-- BEGIN convergence results -->"
DOC_END = "<!-- END convergence results -->"


# ----------------------------------------------------------------------------- results

def result_path(out: pathlib.Path, name: str, seed: int) -> pathlib.Path:
    return out / "runs" / f"{name}_s{seed}.json"


def write_json(path: pathlib.Path, obj, indent=None):
    """Writes obj as JSON to path atomically (a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(obj, indent=indent, separators=None if indent else (",", ":"))
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _g(v, digits=6):
    """v rounded to `digits` significant digits (None and non-finite values as None)."""
    if v is None or not math.isfinite(v):
        return None
    return float(f"{v:.{digits}g}")


def _blocks(n: int, k: int) -> list[tuple[int, int]]:
    """[start, end) step ranges of the blocks of k steps covering n steps."""
    return [(s, min(s + k, n)) for s in range(0, n, k)]


def tail_mean(steps, values, cfg: Config) -> float:
    """Mean of the values recorded after step cfg.tail_start (the last part of a run)."""
    picked = [v for s, v in zip(steps, values) if s > cfg.tail_start]
    if not picked:
        raise ValueError(f"no values after step {cfg.tail_start}")
    return float(np.mean(picked))


def tail_change(steps, values, cfg: Config) -> float | None:
    """How much the least-squares line through the values recorded after cfg.tail_start
    changes over the last part of a run (its slope times the part's length in steps);
    None with fewer than two values there. Near 0: the run ends on a flat part."""
    pts = [(s, v) for s, v in zip(steps, values) if s > cfg.tail_start]
    if len(pts) < 2:
        return None
    x, y = np.asarray(pts, np.float64).T
    return float(np.polyfit(x, y, 1)[0] * (cfg.steps - cfg.tail_start))


def result_of(record: dict, cfg: Config, header: dict) -> dict:
    """The file of one finished (run, seed): its configuration, losses and downsampled
    curves (the record keeps every step; the file keeps blocks of cfg.record_every)."""
    n = record["steps_done"]
    if n != cfg.steps or len(record["train_loss"]) != n:
        raise ValueError(f"record of {record['run']} has {n} steps, not {cfg.steps}")
    tl, gn = np.asarray(record["train_loss"]), np.asarray(record["grad_norm"])
    blocks = _blocks(n, cfg.record_every)
    curves = {"val_steps": record["val_steps"],
              "val_loss": [_g(v) for v in record["val_loss"]],
              "block_end": [e for _, e in blocks],
              "train_loss": [_g(tl[s:e].mean()) for s, e in blocks],
              "train_loss_max": [_g(tl[s:e].max()) for s, e in blocks],
              "grad_norm": [_g(gn[s:e].mean()) for s, e in blocks],
              "grad_norm_max": [_g(gn[s:e].max()) for s, e in blocks]}
    tracked = {label: {"amax_max": [_g(max(s["amax"][a:b]), 4) for a, b in blocks],
                       "scale_end": [_g(s["scale"][b - 1], 4) for _, b in blocks]}
               for label, s in record["fp8_tracked"].items() if len(s["amax"]) == n}
    und = record["e5m2_underflow"]
    underflow = {"steps": und["steps"], "layers": {
        label: {k: [_g(v, 4) for v in vals] for k, vals in s.items()}
        for label, s in und["layers"].items()}}
    timed_s = record["timed_s"]
    return {
        **header,
        "run": record["run"], "seed": record["seed"], "config": record["config"],
        "description": record["description"], "kind": record["kind"],
        "recipe": record["recipe"], "grad_scale": record["grad_scale"],
        "grad_dtype": record["grad_dtype"], "steps": n,
        "final_val_loss": record["val_loss"][-1],
        "tail_val_loss": tail_mean(record["val_steps"], record["val_loss"], cfg),
        "tail_val_change": tail_change(record["val_steps"], record["val_loss"], cfg),
        "tail_train_loss": tail_mean(range(1, n + 1), record["train_loss"], cfg),
        "tokens_per_s": (cfg.batch * cfg.seq * record["timed_steps"] / timed_s
                         if timed_s > 0 else None),
        "processes": record["processes"],
        "curves": curves, "fp8_tracked": tracked, "e5m2_underflow": underflow}


def source_commit() -> str | None:
    """The git commit of this script's checkout ('+' when it has local changes), or None."""
    here = pathlib.Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=30)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def load_results(out: pathlib.Path) -> list[dict]:
    """Every finished (run, seed) file under out/runs, sorted by (seed, run)."""
    files = sorted((out / "runs").glob("*_s*.json"))
    got = [json.loads(p.read_text()) for p in files]
    return sorted(got, key=lambda r: (r["seed"], r["run"]))


# ----------------------------------------------------------------------------- summary

def stats(per_seed: dict) -> dict:
    """{"per_seed": {seed: value}, "n", "mean", "std", "ci95"}: std is the sample standard
    deviation (ddof 1) and ci95 the half-width of the mean's 95 % t interval
    (t(0.975, n - 1) * std / sqrt(n)), both None for fewer than two seeds; mean is None
    for none."""
    seeds = sorted(per_seed)
    vals = [per_seed[s] for s in seeds]
    n = len(vals)
    std = float(np.std(vals, ddof=1)) if n > 1 else None
    return {"per_seed": {str(s): per_seed[s] for s in seeds}, "n": n,
            "mean": float(np.mean(vals)) if vals else None, "std": std,
            "ci95": (float(scipy.stats.t.ppf(0.975, n - 1) * std / math.sqrt(n))
                     if std is not None else None)}


ALONG_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0)


def along_steps(val_steps, steps: int) -> list[int]:
    """The evaluation steps at which the paired difference is followed along a run: the
    first evaluation at or after each of ALONG_FRACTIONS of the run."""
    picked = []
    for f in ALONG_FRACTIONS:
        later = [s for s in val_steps if s >= round(f * steps)]
        if later and later[0] not in picked:
            picked.append(later[0])
    return picked


def paired_along(run: dict, ref: dict, steps: list[int]) -> dict:
    """{"steps", "stats"}: at each of ``steps``, stats over seeds of the difference of the
    validation loss to the reference run of the same seed, in % of the reference's."""
    out = []
    for step in steps:
        per_seed = {}
        for seed, r in run.items():
            if seed not in ref:
                continue
            a, b = (dict(zip(x["curves"]["val_steps"], x["curves"]["val_loss"]))
                    for x in (r, ref[seed]))
            if step in a and step in b:
                per_seed[seed] = 100.0 * (a[step] - b[step]) / b[step]
        out.append(stats(per_seed))
    return {"steps": list(steps), "stats": out}


_DATA_KEYS = ("python", "files_train", "files_val", "bytes_train", "bytes_val")
SUMMARIZED = ("final_val_loss", "tail_val_loss", "tail_train_loss")


def summarize(results: list[dict]) -> dict:
    """results.json from the files of finished (run, seed)s: per run, every seed's final
    and last-part losses, their mean and std over seeds, the paired difference to bf16
    of the same seed (in %, with mean and std over the seeds both have), and the curves.

    Raises SystemExit when there are no results or they do not share one configuration
    and one data set (such runs are not comparable)."""
    if not results:
        raise SystemExit("no finished runs to summarize")
    first = results[0]
    for r in results[1:]:
        for key, a, b in (("config", first["config"], r["config"]),
                          ("data", {k: first["data"].get(k) for k in _DATA_KEYS},
                           {k: r["data"].get(k) for k in _DATA_KEYS})):
            if a != b:
                diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                raise SystemExit(f"{r['run']} seed {r['seed']} has another {key} than "
                                 f"{first['run']} seed {first['seed']}: {diff}")
    by_run: dict[str, dict[int, dict]] = {}
    for r in results:
        by_run.setdefault(r["run"], {})[r["seed"]] = r
    order = [n for n in RUNS if n in by_run] + sorted(n for n in by_run if n not in RUNS)
    ref = by_run.get(REFERENCE, {})
    runs = {}
    for name in order:
        seeds = by_run[name]
        some = next(iter(seeds.values()))
        entry = {"description": some["description"], "recipe": some["recipe"],
                 "seeds": sorted(seeds)}
        for key in SUMMARIZED + ("tail_val_change", "tokens_per_s"):
            entry[key] = stats({s: r[key] for s, r in seeds.items()
                                if r.get(key) is not None})
        if name != REFERENCE:
            entry["vs_bf16_pct"] = {
                key: stats({s: 100.0 * (r[key] - ref[s][key]) / ref[s][key]
                            for s, r in seeds.items() if s in ref})
                for key in SUMMARIZED}
            entry["vs_bf16_val_along_pct"] = paired_along(
                seeds, ref, along_steps(some["curves"]["val_steps"], first["config"]["steps"]))
        entry["source_commits"] = {str(s): r.get("source_commit") for s, r in sorted(seeds.items())}
        entry["devices"] = sorted({r["device"] for r in seeds.values()})
        entry["curves"] = {
            "val_steps": some["curves"]["val_steps"],
            "val_loss": {str(s): r["curves"]["val_loss"] for s, r in sorted(seeds.items())},
            "block_end": some["curves"]["block_end"],
            "train_loss": {str(s): r["curves"]["train_loss"] for s, r in sorted(seeds.items())}}
        runs[name] = entry
    cfg = Config(**first["config"])
    return {"protocol": {"preset": first.get("preset"), "config": first["config"],
                         "decay_end": cfg.decay_end, "tail_start": cfg.tail_start,
                         "params": first["params"], "tokens_per_step": first["tokens_per_step"],
                         "flops_per_token": first["flops_per_token"], "data": first["data"],
                         "attention": sorted({r["attention"] for r in results})},
            "devices": sorted({r["device"] for r in results}),
            "jax_versions": sorted({r["jax_version"] for r in results}),
            "source_commits": sorted({r.get("source_commit") or "unknown" for r in results}),
            "reference": REFERENCE, "runs": runs}


def _pm(st: dict, spec=".4f", unit="") -> str:
    if not st["n"]:
        return "—"
    sign = "+" if spec.startswith("+") else ""
    text = format(st["mean"], spec)
    if st["std"] is not None:
        text += f" ± {format(st['std'], spec.lstrip(sign))}"
    return text + unit


def markdown_tables(summary: dict) -> str:
    """The results as Markdown: one table of means over seeds, one per-seed table."""
    p = summary["protocol"]
    steps, tail = p["config"]["steps"], p["tail_start"]
    pct = f"{100 * p['config']['tail_fraction']:g} %"
    tail_name = f"last {pct}"
    runs = summary["runs"]
    lines = [f"| run | seeds | final val loss | val loss, {tail_name} | final vs bf16 "
             f"(paired) | its 95 % interval | {tail_name} vs bf16 (paired) | train loss, "
             f"{tail_name} | val loss change over the {tail_name} | tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in runs.items():
        vs = e.get("vs_bf16_pct")
        def paired(key):
            if vs is None:  # noqa: B023 (called in this iteration)
                return "—"
            st = vs[key]  # noqa: B023
            return f"{_pm(st, '+.2f', ' %')} (n={st['n']})" if st["n"] else "no bf16 seed"
        def interval(key):
            st = (vs or {}).get(key)  # noqa: B023
            if not st or st["ci95"] is None:
                return "—"
            lo, hi = st["mean"] - st["ci95"], st["mean"] + st["ci95"]
            return f"{lo:+.2f} … {hi:+.2f} %"
        tok = e["tokens_per_s"]
        tok_text = f"{tok['mean'] / 1e3:.1f}k" if tok["n"] else "—"
        lines.append(f"| `{name}` | {len(e['seeds'])} | {_pm(e['final_val_loss'])} | "
                     f"{_pm(e['tail_val_loss'])} | {paired('final_val_loss')} | "
                     f"{interval('final_val_loss')} | {paired('tail_val_loss')} | "
                     f"{_pm(e['tail_train_loss'])} | "
                     f"{_pm(e['tail_val_change'], '+.4f')} | {tok_text} |")
    seeds = sorted({s for e in runs.values() for s in e["seeds"]})
    val_steps = next(iter(runs.values()))["curves"]["val_steps"]
    tail_evals = [s for s in val_steps if s > tail]
    lines += ["", f"Mean ± sample standard deviation over seeds. Last {pct}: the mean of "
              f"the {len(tail_evals)} evaluations after step {tail:,} (steps "
              f"{tail_evals[0]:,} to {tail_evals[-1]:,}), and of the train losses of steps "
              f"{tail + 1:,} to {steps:,}. Paired: the difference to bf16 of the same seed, "
              f"in % of bf16's, averaged over the seeds both runs have (n); its 95 % "
              f"interval is mean ± t(0.975, n − 1) · std / √n (an interval that contains 0: "
              f"no difference this experiment can show). Change over the "
              f"last {pct}: the slope of the least-squares line through those evaluations "
              f"times {steps - tail:,} steps (near 0: the run ends on a flat part).", "",
              f"Per seed: final validation loss / {tail_name}; in brackets, each one's "
              "difference to bf16 of the same seed.", "",
              "| run | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "| --- |" + " --- |" * len(seeds)]
    for name, e in runs.items():
        cells = []
        for s in map(str, seeds):
            if s not in e["final_val_loss"]["per_seed"]:
                cells.append("")
                continue
            cell = (f"{e['final_val_loss']['per_seed'][s]:.4f} / "
                    f"{e['tail_val_loss']['per_seed'][s]:.4f}")
            vs = e.get("vs_bf16_pct")
            if vs is not None and s in vs["final_val_loss"]["per_seed"]:
                cell += (f" ({vs['final_val_loss']['per_seed'][s]:+.2f} % / "
                         f"{vs['tail_val_loss']['per_seed'][s]:+.2f} %)")
            cells.append(cell)
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    along = {name: e["vs_bf16_val_along_pct"] for name, e in runs.items()
             if "vs_bf16_val_along_pct" in e}
    if along:
        at = next(iter(along.values()))["steps"]
        lines += ["", "Along the run: the paired difference of the validation loss to bf16 of "
                  "the same seed, in %, mean ± std over seeds (n), at "
                  + ", ".join(f"{s:,}" for s in at) + " steps.", "",
                  "| run | " + " | ".join(f"step {s:,}" for s in at) + " |",
                  "| --- |" + " --- |" * len(at)]
        for name, a in along.items():
            lines.append(f"| `{name}` | " + " | ".join(
                f"{_pm(st, '+.2f', ' %')} (n={st['n']})" if st["n"] else "—"
                for st in a["stats"]) + " |")
    return "\n".join(lines)


def doc_block(summary: dict, tables: str, out: pathlib.Path, plots: list[pathlib.Path],
              doc: pathlib.Path) -> str:
    """The text between the doc's result markers: where the runs ran, tables, plots."""
    n = sum(len(e["seeds"]) for e in summary["runs"].values())
    commits = ", ".join(c[:12] if c != "unknown" else c for c in summary["source_commits"])
    head = (f"{n} finished (run, seed) pairs on {', '.join(summary['devices'])} (jax "
            f"{', '.join(summary['jax_versions'])}; source {commits}); all figures in "
            f"[`results.json`]({_rel(doc, out / 'results.json')}).")
    parts = [DOC_BEGIN, "<!-- written by examples/convergence.py --summarize --doc -->", "",
             head, "", tables, ""]
    for p in plots:
        parts += [f"![{p.stem}]({_rel(doc, p)})", ""]
    return "\n".join(parts + [DOC_END])


def _rel(doc: pathlib.Path, target: pathlib.Path) -> str:
    return pathlib.Path(os.path.relpath(target.resolve(), doc.resolve().parent)).as_posix()


def update_doc(doc: pathlib.Path, block: str) -> None:
    """Replaces the doc's text from its DOC_BEGIN line to its DOC_END line with block."""
    text = doc.read_text(encoding="utf-8")
    i, j = text.find(DOC_BEGIN), text.find(DOC_END)
    if i < 0 or j < i:
        raise SystemExit(f"{doc} has no {DOC_BEGIN} ... {DOC_END} lines to write between")
    doc.write_text(text[:i] + block + text[j + len(DOC_END):], encoding="utf-8")


# ----------------------------------------------------------------------------- plots

def _pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (pip install matplotlib)")
        return None
    return plt


def _moving_mean(y, k):
    """Moving mean over k points along the last axis ('valid': len - k + 1 points)."""
    y = np.asarray(y, np.float64)
    if k <= 1 or y.shape[-1] < 2 * k:
        return y, 0
    c = np.cumsum(np.concatenate([np.zeros(y.shape[:-1] + (1,)), y], axis=-1), axis=-1)
    return (c[..., k:] - c[..., :-k]) / k, k - 1


def _band(ax, x, per_seed, color, label, **kw):
    """Mean over seeds (rows of per_seed) as a line, +-1 sample std as a band."""
    y = np.asarray(per_seed, np.float64)
    mean = y.mean(axis=0)
    ax.plot(x, mean, color=color, label=label, lw=1.2, **kw)
    if len(y) > 1:
        sd = y.std(axis=0, ddof=1)
        ax.fill_between(x, mean - sd, mean + sd, color=color, alpha=0.2, lw=0)
    return mean


def plot_summary(summary: dict, results: list[dict], out: pathlib.Path,
                 plot_seed: int | None = None) -> list[pathlib.Path]:
    """loss.png (train loss, validation loss, validation loss vs bf16's in %: mean over
    seeds with a +-1 std band) and fp8.png (amax, scale and underflow of one seed)."""
    made = None
    if "MPLCONFIGDIR" not in os.environ:   # matplotlib's font cache: inside out, removed
        made = os.environ["MPLCONFIGDIR"] = tempfile.mkdtemp(prefix=".matplotlib-", dir=out)
    try:
        plt = _pyplot()
        if plt is None:
            return []
        return [_plot_losses(summary, out, plt),
                *_plot_fp8(summary, results, out, plt, plot_seed)]
    finally:
        if made is not None:
            os.environ.pop("MPLCONFIGDIR", None)
            shutil.rmtree(made, ignore_errors=True)


# The plots are read on a documentation page about 1000 px wide: three panels stacked, the
# figure as wide as the page at its dpi (9 in at 110 dpi), legends at 9 pt (about 14 px).
PAGE_FIGSIZE = (9.0, 12.0)
LEGEND_PT = 9


def _title(summary):
    p = summary["protocol"]
    c = p["config"]
    return (f"byte GPT {p['params'] / 1e6:.1f}M params, d={c['d_model']} L={c['layers']} "
            f"T={c['seq']} B={c['batch']}, {c['steps']} steps; "
            f"{', '.join(summary['devices'])}; band: ±1 std over seeds")


def _plot_losses(summary, out, plt):
    p = summary["protocol"]
    steps, tail = p["config"]["steps"], p["tail_start"]
    runs = summary["runs"]
    ref = runs.get(REFERENCE)
    fig, axes = plt.subplots(3, 1, figsize=PAGE_FIGSIZE)
    late_train, late_val, late_diff = [], [], []
    for ri, (name, e) in enumerate(runs.items()):
        color, label = f"C{ri}", f"{name} (n={len(e['seeds'])})"
        cur = e["curves"]
        blocks = np.asarray(cur["block_end"])
        k = max(1, len(blocks) // 50)
        y, lag = _moving_mean([cur["train_loss"][s] for s in map(str, e["seeds"])], k)
        x = blocks[lag:]
        m = _band(axes[0], x, y, color, label)
        late_train += m[x >= steps // 10].tolist()
        vx = np.asarray(cur["val_steps"])
        vals = [cur["val_loss"][s] for s in map(str, e["seeds"])]
        m = _band(axes[1], vx, vals, color, label, marker=".", ms=3)
        late_val += m[vx >= steps // 10].tolist()
        if ref is not None and name != REFERENCE:
            common = [s for s in map(str, e["seeds"]) if s in ref["curves"]["val_loss"]]
            if common:
                d = [100.0 * (np.asarray(cur["val_loss"][s]) -
                              np.asarray(ref["curves"]["val_loss"][s]))
                     / np.asarray(ref["curves"]["val_loss"][s]) for s in common]
                m = _band(axes[2], vx, d, color, f"{name} (n={len(common)})", marker=".",
                          ms=3)
                late_diff += m[vx >= steps // 10].tolist()
    for ax, v in ((axes[0], late_train), (axes[1], late_val), (axes[2], late_diff)):
        if v:
            lo, hi = min(v), max(v)
            pad = 0.1 * (hi - lo) + 0.02
            ax.set_ylim(lo - pad, hi + 2 * pad)
        ax.axvspan(tail, steps, color="0.9", zorder=0)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=LEGEND_PT, loc="upper right")
    axes[0].set_title("train loss (nats/byte, block means)")
    axes[1].set_title("validation loss (nats/byte); grey: the averaged last part")
    axes[2].axhline(0, color="k", lw=0.6)
    axes[2].set_title("validation loss vs bf16 of the same seed (%)")
    fig.suptitle(_title(summary).replace("; ", "\n", 1), fontsize=LEGEND_PT + 1)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.05, top=0.93, hspace=0.38)
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_fp8(summary, results, out, plt, plot_seed):
    """fp8.png for one seed (plot_seed, else the lowest seed with tracked FP8 state)."""
    from matplotlib.lines import Line2D
    tracked_seeds = sorted({r["seed"] for r in results if r["fp8_tracked"]})
    seed = plot_seed if plot_seed is not None else (tracked_seeds or [None])[0]
    chosen = {r["run"]: r for r in results if r["seed"] == seed}
    if not chosen:
        return []
    runs = {n: chosen[n] for n in summary["runs"] if n in chosen}
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
    fig, axes = plt.subplots(3, 1, figsize=PAGE_FIGSIZE)
    tensors, layers = {}, {}             # colours per tensor / layer,
    shown_track, shown_und = {}, {}      # line styles per run
    for ri, (name, r) in enumerate(runs.items()):
        ls = styles[ri % len(styles)]
        x = r["curves"]["block_end"]
        for label, series in r["fp8_tracked"].items():
            c = tensors.setdefault(label, f"C{len(tensors)}")
            axes[0].semilogy(x, series["amax_max"], ls=ls, color=c, lw=1)
            axes[1].semilogy(x, series["scale_end"], ls=ls, color=c, lw=1)
            shown_track[name] = ls
        und = r["e5m2_underflow"]
        for label, s in und["layers"].items():
            c = layers.setdefault(label, f"C{len(layers)}")
            own = [np.nan if v is None else v for v in s["run_scale"]]
            if r["grad_scale"] == "state" and not np.all(np.isnan(own)):
                axes[2].plot(und["steps"], own, ls=ls, color=c, marker=".", lw=1)
            elif r["grad_scale"] == "current" or name == REFERENCE:
                axes[2].plot(und["steps"], [np.nan if v is None else v
                                            for v in s["current_scale"]],
                             ls=ls, color=c, marker="x", lw=0.8)
            else:
                continue
            shown_und[name] = ls
    axes[0].set_title(f"seed {seed}: largest newest amax per block of steps")
    axes[1].set_title("scale (x * scale -> FP8) at the end of each block")
    axes[2].set_title("gradient underflow: nonzero bf16 grads -> 0 in the run's FP8 type\n"
                      "(delayed: its scale; current and bf16: max / amax)")
    axes[2].set_yscale("symlog", linthresh=1e-6)
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)

    def run_handles(shown):
        return [Line2D([], [], color="k", ls=ls, lw=1, label=n) for n, ls in shown.items()]
    if tensors:
        axes[0].legend(handles=run_handles(shown_track), fontsize=LEGEND_PT, loc="upper right")
        axes[1].legend(handles=[Line2D([], [], color=c, lw=2, label=t)
                                for t, c in tensors.items()], fontsize=LEGEND_PT,
                       loc="upper right")
    if layers:
        axes[2].legend(handles=[Line2D([], [], color=c, lw=2, label=t)
                                for t, c in layers.items()] + run_handles(shown_und),
                       fontsize=LEGEND_PT - 1, loc="upper right", ncol=2)
    fig.suptitle(_title(summary).split(";")[0] + f"; seed {seed}", fontsize=LEGEND_PT + 1)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.05, top=0.93, hspace=0.38)
    path = out / "fp8.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
