"""Convergence of FP8 training against bf16: a byte-level GPT trained per recipe and seed.

This file is the command line and the training loop (progress, checkpoints, resuming);
convergence_setup.py holds the configuration, runs, model and data, convergence_report.py
the results, statistics, tables and plots.

The same decoder-only transformer is trained once per *run* and *seed*; the runs of one
seed start from the same initial weights and see the same batches, and differ only in
how the attention projections and MLP Dense layers compute their GEMMs:

  bf16                  plain nn.Dense, bf16 compute (the reference)
  jax_fp8_delayed       jax_fp8.flax.Fp8DotGeneral, DelayedScaling(HYBRID, history 1024):
                        E4M3 inputs and kernels, E5M2 gradients, one fused FP8-state
                        update per step (jax_fp8.flax.Fp8TrainState)
  jax_fp8_delayed_h16   the same with a 16-step amax history
  jax_fp8_blockwise     Fp8DotGeneral with Float8BlockScaling() (E4M3, 1x128 / 128x128)
  jax_fp8_current       Fp8DotGeneral with Float8CurrentScaling() (per-tensor, no state)
  jax_fp8_delayed_e4m3  DelayedScaling(E4M3, history 1024): E4M3 gradients too
  flax_fp8              flax.linen.Fp8DirectDotGeneralOp (history 1024), its
                        "_overwrite_with_gradient" collection handled the usual Flax way

The first five are the default ``--runs``; ``--runs all`` adds the last two. A recipe run
is skipped, with a message, when the installed jax_fp8 does not provide or accept it.

Model: GPT-style, pre-LayerNorm, causal multi-head attention, GELU MLP (4x), learned
positions, untied LM head, vocabulary 256 (bytes). Parameters are float32; compute is
bf16. The qkv / attention-output / MLP-in / MLP-out Dense layers are the FP8 GEMMs; the
embeddings, the layer norms, the attention itself (jax.nn.dot_product_attention) and the
LM head stay in bf16 in every run, as in Transformer Engine.

Data: the Python standard library's own source files of the running interpreter
(``sysconfig.get_paths()["stdlib"]``, every ``*.py`` below it, sorted, ``site-packages``
excluded), read as bytes, split into train and validation *by file* (``--data-seed``),
each file followed by a 0 byte. With seed S, the initial weights come from
``jax.random.key(S)`` and batch ``s`` is ``batch`` windows of ``seq + 1`` bytes at offsets
drawn by ``numpy.random.default_rng([S, 0, s])``. The validation windows depend on the
data seed only: the same for every run, seed and evaluation.

Optimizer: AdamW (b1 0.9, b2 0.95, weight decay on matrices), linear warmup to ``--lr``,
cosine decay to ``--lr * --min-lr-ratio`` at step ``--decay-fraction * --steps``, then
that floor to the end; gradient clipping at global norm ``--clip``.

Files under ``--out DIR``:

  DIR/runs/<run>_s<seed>.json  one finished (run, seed): its configuration, final and
                               last-part losses, curves (validation loss at every
                               evaluation; train loss and gradient norm as means and
                               maxima over blocks of ``--record-every`` steps), tracked
                               FP8 amaxes and scales, gradient-underflow probes, tokens/s;
                               written atomically when the run ends
  DIR/results.json, DIR/loss.png, DIR/fp8.png   written by ``--summarize`` from DIR/runs/

A (run, seed) whose file exists is skipped. An unfinished one continues from its latest
orbax checkpoint under ``--ckpt-dir`` (default DIR/ckpt/<run>_s<seed>/, written every
``--ckpt-every`` steps and when ``--max-minutes`` or ``--stop-after`` stops the process,
removed when the run's file is written), so the same command, run again, carries on
where the last one stopped. Work is done seed by seed, each seed's runs in ``--runs``
order; each run's train step is compiled once per process and reused for every seed.

    python examples/convergence.py --preset smoke --seeds 0,1 --out runs/conv_smoke  # CPU
    python examples/convergence.py --preset h200 --seeds 0,1,2 --out runs/conv --max-minutes 9
    python examples/convergence.py --summarize --out runs/conv    # results.json, plots, tables

``--summarize`` (no training) collects DIR/runs/*.json into DIR/results.json: for every
run, each seed's final validation loss and the mean validation loss over the last
``--tail-fraction`` of the steps, their mean and sample standard deviation over seeds,
and the paired difference to bf16 of the same seed (in %, with its mean and standard
deviation); it draws the plots (mean curve and a +-1 std band over seeds per run), prints
the Markdown tables and, with ``--doc``, writes them into that page between its
``<!-- BEGIN convergence results -->`` and ``<!-- END convergence results -->`` lines.

``--max-minutes M`` stops before M minutes have passed since the script started: it
checkpoints the run in progress and exits with status 0 (``--exit-code-unfinished 3``
makes it status 3, for a calling script).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import shutil
import sys
import time

_STARTED = time.monotonic()   # --max-minutes counts from here (before the imports below)

import flax
import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8

try:
    from tqdm.auto import tqdm
except ImportError:  # progress lines instead of a bar
    tqdm = None

from convergence_report import (
    DOC_BEGIN,
    DOC_END,
    doc_block,
    load_results,
    markdown_tables,
    plot_summary,
    result_of,
    result_path,
    source_commit,
    summarize,
    update_doc,
    write_json,
)
from convergence_setup import (
    GPT,
    PRESETS,
    PROTOCOL_RUNS,
    RUNS,
    ByteData,
    Config,
    Run,
    Skip,
    count_params,
    flops_per_token,
    log,
    probed_layers,
    tracked_tensors,
)

# ----------------------------------------------------------------------------- progress

class Progress:
    """One bar per run (tqdm) on a terminal; a line every ~10 % (or minute) otherwise."""

    def __init__(self, desc: str, total: int, initial: int = 0):
        self.desc, self.total, self.n = desc, total, initial
        self.bar = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                            dynamic_ncols=True, file=sys.stderr)
        self.every = max(1, total // 10)
        self.last_line, self.last_time = initial, time.monotonic()

    def update(self, n: int, **postfix):
        text = "  ".join(f"{k} {v}" for k, v in postfix.items())
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            self.bar.set_postfix_str(text, refresh=True)
        elif (n - self.last_line >= self.every or n == self.total
              or time.monotonic() - self.last_time > 60):
            print(f"[{self.desc}] step {n}/{self.total}  {text}", file=sys.stderr, flush=True)
            self.last_line, self.last_time = n, time.monotonic()
        self.n = n

    def close(self):
        if self.bar is not None:
            self.bar.close()




# ----------------------------------------------------------------------------- checkpoints

def checkpoint_manager(path: pathlib.Path):
    import orbax.checkpoint as ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(path.resolve(), options=options,
                                 item_names=("state", "record"))


def save_checkpoint(mngr, step, state, record):
    import orbax.checkpoint as ocp
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            record=ocp.args.JsonSave(record)), force=True)
    mngr.wait_until_finished()


def restore_record(mngr, step):
    import orbax.checkpoint as ocp
    return mngr.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]


def restore_checkpoint(mngr, step, target):
    import orbax.checkpoint as ocp
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     record=ocp.args.JsonRestore()))
    return got["state"], got["record"]


# ----------------------------------------------------------------------------- the loop

class Deadline:
    """--max-minutes: is there time left for `seconds` more work (and a checkpoint)?"""

    def __init__(self, started: float, max_minutes: float | None):
        self.end = None if max_minutes is None else started + 60.0 * max_minutes

    def allows(self, seconds: float) -> bool:
        return self.end is None or time.monotonic() + seconds < self.end


def new_record(run: Run, seed: int) -> dict:
    """The per-step record of one (run, seed) while it trains (kept in its checkpoints)."""
    cfg = run.cfg
    return {"run": run.name, "seed": seed, "config": cfg.comparable(),
            "description": run.spec.description, "kind": run.kind,
            "recipe": None if run.recipe is None else repr(run.recipe),
            "grad_scale": run.spec.grad_scale, "grad_dtype": run.spec.grad_dtype,
            "train_loss": [], "grad_norm": [], "val_steps": [], "val_loss": [],
            "fp8_tracked": {label: {"amax": [], "scale": []}
                            for label, *_ in tracked_tensors(cfg)} if run.has_fp8_state
            else {},
            "e5m2_underflow": {"steps": [], "layers": {
                label: {"run_scale": [], "current_scale": [], "grad_amax": []}
                for label, *_ in probed_layers(cfg)}},
            "timed_steps": 0, "timed_s": 0.0, "processes": [], "steps_done": 0}


def train_run(run: Run, seed: int, cfg: Config, data: ByteData, params0,
              ckpt_dir: pathlib.Path, args, deadline: Deadline) -> tuple[dict, bool]:
    """Trains one (run, seed) from step 0 or from its latest checkpoint in ckpt_dir;
    returns (its record, finished). A checkpoint of another configuration or seed is an
    error (SystemExit), never continued."""
    tag = f"{run.name} s{seed}"
    mngr, latest = None, None
    if ckpt_dir.exists():
        mngr = checkpoint_manager(ckpt_dir)
        latest = mngr.latest_step()
        if latest is not None:
            saved = restore_record(mngr, latest)
            if (saved.get("config"), saved.get("run"), saved.get("seed")) != (
                    cfg.comparable(), run.name, seed):
                mngr.close()
                raise SystemExit(f"{ckpt_dir} holds a checkpoint of another configuration "
                                 f"({saved.get('run')}, seed {saved.get('seed')}, "
                                 f"{saved.get('config')}): remove it or use another "
                                 f"--ckpt-dir")
            if latest >= cfg.steps:
                mngr.close()
                return saved, True

    state = run.fresh_state(params0)
    record = new_record(run, seed)
    proc = {"start_step": 0, "device": jax.devices()[0].device_kind}
    try:
        step_fn, proc["compile_s"] = run.step_fn(state, jnp.asarray(data.train_batch(seed, 0)))
    except Skip:
        if mngr is not None:
            mngr.close()
        raise
    proc["compile_s"] = round(proc["compile_s"], 3)
    if proc["compile_s"]:
        log(f"[{run.name}] compiled the step in {proc['compile_s']:.1f} s")
    val = [jnp.asarray(b) for b in data.val_batches(cfg.eval_batches)]

    start = 0
    if latest is not None:
        state, record = restore_checkpoint(mngr, latest, state)
        start = int(state.step)
        if start != latest:
            raise RuntimeError(f"checkpoint {latest} holds a state at step {start}")
        for key in ("train_loss", "grad_norm"):
            del record[key][start:]
        proc["start_step"] = start
        log(f"[{tag}] resumed from {ckpt_dir} at step {start}")
    if mngr is None:
        mngr = checkpoint_manager(ckpt_dir)
    eval_s = 0.0

    def evaluate(step):
        nonlocal eval_s
        t = time.perf_counter()
        v = float(np.mean(jax.device_get([run.eval_fn(state, b) for b in val])))
        eval_s = time.perf_counter() - t
        if record["val_steps"] and record["val_steps"][-1] == step:
            record["val_loss"][-1] = v
        else:
            record["val_steps"].append(step)
            record["val_loss"].append(v)
        return v

    pending = []

    def flush():
        for m in jax.device_get(pending):
            step_taken = len(record["train_loss"])
            if step_taken % cfg.probe_every == 0:
                und = record["e5m2_underflow"]
                und["steps"].append(step_taken)
                for (label, *_), (own, cur, amax) in zip(probed_layers(cfg), m["underflow"]):
                    series = und["layers"][label]
                    series["run_scale"].append(None if np.isnan(own) else float(own))
                    series["current_scale"].append(float(cur))
                    series["grad_amax"].append(float(amax))
            record["train_loss"].append(float(m["loss"]))
            record["grad_norm"].append(float(m["grad_norm"]))
            if "track" in m:
                for (label, *_), (amax, scale) in zip(tracked_tensors(cfg), m["track"]):
                    record["fp8_tracked"][label]["amax"].append(float(amax))
                    record["fp8_tracked"][label]["scale"].append(float(scale))
        pending.clear()

    timed_s, timed_steps, seg_t, seg_steps = 0.0, 0, None, 0
    ckpt_s = None
    step_s = None
    tokens_per_step = cfg.batch * cfg.seq
    bar = Progress(tag, cfg.steps, start)
    stopped = None
    if start == 0:
        evaluate(0)
    t_loop = time.perf_counter()
    step = start
    try:
        while step < cfg.steps:
            batch = jnp.asarray(data.train_batch(seed, step))
            if seg_t is None and step - start >= cfg.timing_warmup:
                seg_t = time.perf_counter()   # time from here to the next sync point
            state, metrics = step_fn(state, batch)
            pending.append(metrics)
            step += 1
            done_here = step - start
            if seg_t is not None:
                seg_steps += 1
            boundary = (step % cfg.log_every == 0 or step == cfg.steps
                        or step % cfg.eval_every == 0 or step % cfg.ckpt_every == 0
                        or done_here == cfg.timing_warmup
                        or (args.stop_after is not None and done_here >= args.stop_after))
            if not boundary:
                continue
            flush()                           # waits for the step
            now = time.perf_counter()
            if seg_t is not None and seg_steps:
                timed_s += now - seg_t
                timed_steps += seg_steps
                step_s = timed_s / timed_steps
            seg_t, seg_steps = None, 0
            if step % cfg.eval_every == 0 or step == cfg.steps:
                evaluate(step)
            stop = args.stop_after is not None and done_here >= args.stop_after
            # Time to reach the next sync point, evaluate, checkpoint and exit (before the
            # first timed segment the step time is unknown: the steps so far include
            # compilation, so they would overstate it many times).
            reserve = (2 * (ckpt_s or 10.0) + 2 * cfg.log_every * (step_s or 0.0)
                       + 2 * eval_s + 15.0)
            if not stop and step < cfg.steps and not deadline.allows(reserve):
                stop = True
            if (step % cfg.ckpt_every == 0 and step < cfg.steps) or (stop and step < cfg.steps):
                t = time.perf_counter()
                proc["loop_s"] = round(t - t_loop, 3)
                _finish_record(record, proc, step, timed_s, timed_steps)
                save_checkpoint(mngr, step, state, record)
                ckpt_s = time.perf_counter() - t
            tok_s = tokens_per_step * timed_steps / timed_s if timed_s > 0 else float("nan")
            bar.update(step, loss=f"{record['train_loss'][-1]:.4f}",
                       val=f"{record['val_loss'][-1]:.4f}",
                       tok_s=f"{tok_s:,.0f}" if timed_s > 0 else "-")
            if stop:
                stopped = step
                break
    finally:
        bar.close()
        mngr.close()
    proc["loop_s"] = round(time.perf_counter() - t_loop, 3)
    _finish_record(record, proc, step, timed_s, timed_steps)
    if stopped is not None and stopped < cfg.steps:
        log(f"[{tag}] stopped at step {stopped}/{cfg.steps} (checkpointed); the same "
            f"command continues it")
        return record, False
    return record, True


def _finish_record(record, proc, step, timed_s, timed_steps):
    """Folds this process's counters into the record (idempotent within a process)."""
    proc.update(end_step=step, timed_steps=timed_steps, timed_s=round(timed_s, 4))
    procs = [p for p in record["processes"] if p.get("start_step") != proc["start_step"]]
    record["processes"] = procs + [dict(proc)]
    record["timed_steps"] = sum(p["timed_steps"] for p in record["processes"])
    record["timed_s"] = sum(p["timed_s"] for p in record["processes"])
    record["steps_done"] = step


# ----------------------------------------------------------------------------- main

def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals) or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 0, got {text!r}")
    return vals


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--runs", default="protocol",
                    help=f"comma-separated; 'protocol' (the default): {','.join(PROTOCOL_RUNS)}"
                         f"; 'all': {','.join(RUNS)}")
    ap.add_argument("--seeds", type=_int_list, default=[0],
                    help="comma-separated seeds (default 0): initial weights and batch order")
    ap.add_argument("--out", default="runs/convergence",
                    help="results: OUT/runs/<run>_s<seed>.json; --summarize writes "
                         "OUT/results.json and the plots")
    ap.add_argument("--ckpt-dir", default=None,
                    help="checkpoints of unfinished runs (default OUT/ckpt)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="checkpoint and exit before this many minutes since the start")
    ap.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                    help="checkpoint each (run, seed) after this many steps of this process "
                         "and go on to the next (as --max-minutes does; for testing)")
    ap.add_argument("--exit-code-unfinished", type=int, default=0,
                    help="exit status when a requested run is not finished (default 0)")
    ap.add_argument("--summarize", action="store_true",
                    help="no training: OUT/results.json, the plots and the tables from "
                         "OUT/runs/*.json")
    ap.add_argument("--doc", default=None,
                    help="with --summarize: write the tables and plot links into this "
                         f"Markdown file, between its {DOC_BEGIN} and {DOC_END} lines")
    ap.add_argument("--plot-seed", type=int, default=None,
                    help="with --summarize: the seed fp8.png shows (default: the lowest "
                         "with FP8 state)")
    ap.add_argument("--no-plot", action="store_true", help="with --summarize: no plots")
    ap.add_argument("--source-commit", default=None,
                    help="the source commit to record in the result files (default: what "
                         "git says of this script's checkout, if it is one)")
    ap.add_argument("--attention", choices=["auto", "xla", "cudnn"], default="auto",
                    help="jax.nn.dot_product_attention implementation (auto: cudnn on a "
                         "GPU when it compiles, else xla); the same for every run")
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        ap.add_argument(flag, type=type(getattr(PRESETS["smoke"], field.name)), default=None,
                        dest=field.name, help=f"override the preset's {field.name}")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(PRESETS[args.preset], **{
        f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
        if getattr(args, f.name) is not None})
    if cfg.d_model % cfg.heads:
        ap.error("--d-model must be divisible by --heads")
    for name in ("eval_every", "probe_every", "ckpt_every", "log_every", "steps", "batch",
                 "record_every", "eval_batches"):
        if getattr(cfg, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= cfg.warmup < cfg.decay_end <= cfg.steps:
        ap.error(f"need 0 <= --warmup < --decay-fraction * --steps <= --steps, got warmup "
                 f"{cfg.warmup}, decay end {cfg.decay_end}, steps {cfg.steps}")
    if not 0 < cfg.tail_fraction <= 1 or not 0 <= cfg.min_lr_ratio <= 1:
        ap.error("--tail-fraction must be in (0, 1] and --min-lr-ratio in [0, 1]")
    if args.runs == "protocol":
        names = list(PROTOCOL_RUNS)
    elif args.runs == "all":
        names = list(RUNS)
    else:
        names = [r for r in args.runs.split(",") if r]
    unknown = [r for r in names if r not in RUNS]
    if unknown:
        ap.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    args.run_names = names
    return args, cfg


def pick_attention(choice: str, cfg: Config) -> str:
    if choice != "auto":
        return choice
    if jax.default_backend() != "gpu":
        return "xla"
    hd = cfg.d_model // cfg.heads
    q = jnp.zeros((1, 128, cfg.heads, hd), jnp.bfloat16)
    try:
        f = jax.jit(jax.grad(lambda q: jax.nn.dot_product_attention(
            q, q, q, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()))
        jax.block_until_ready(f(q))
        return "cudnn"
    except Exception as e:  # noqa: BLE001 -- any failure means: not available here
        log(f"cuDNN attention not available ({type(e).__name__}); using xla")
        return "xla"


def run_summarize(args) -> dict:
    out = pathlib.Path(args.out)
    results = load_results(out)
    summary = summarize(results)
    write_json(out / "results.json", summary, indent=1)
    log(f"wrote {out / 'results.json'} ({len(results)} finished runs)")
    plots = [] if args.no_plot else plot_summary(summary, results, out, args.plot_seed)
    for p in plots:
        log(f"wrote {p}")
    tables = markdown_tables(summary)
    print(tables)
    if args.doc:
        doc = pathlib.Path(args.doc)
        update_doc(doc, doc_block(summary, tables, out, plots, doc))
        log(f"wrote the results into {doc}")
    return summary


def status_table(cfg: Config, names, seeds, status: dict) -> str:
    """One line per requested (run, seed): finished (losses), stopped at a step, skipped."""
    lines = [f"{'run':22s} {'seed':>4s}  status"]
    for seed in seeds:
        for name in names:
            st = status.get((name, seed), "not started")
            if isinstance(st, dict):
                st = (f"finished: final val {st['final_val_loss']:.4f}, last-part mean "
                      f"{st['tail_val_loss']:.4f}")
            lines.append(f"{name:22s} {seed:>4d}  {st}")
    return "\n".join(lines)


def main(argv=None, started: float | None = None) -> dict:
    """Trains the requested (run, seed)s that are not finished yet, or summarizes.

    Returns {"finished": {run: {seed: result}}, "skipped": {run: why},
    "unfinished": [[run, seed], ...]} (with --summarize: the results.json contents).
    started: time.monotonic() at which --max-minutes counts from (default: now).
    """
    started = time.monotonic() if started is None else started
    args, cfg = parse_args(argv)
    if args.summarize:
        return run_summarize(args)
    out = pathlib.Path(args.out)
    ckpt_root = pathlib.Path(args.ckpt_dir) if args.ckpt_dir else out / "ckpt"
    status, finished, todo = {}, {}, []
    for seed in args.seeds:
        for name in args.run_names:
            path = result_path(out, name, seed)
            if path.exists():
                got = json.loads(path.read_text())
                if got["config"] != cfg.comparable():
                    raise SystemExit(f"{path} was made with another configuration "
                                     f"({got['config']}); use another --out")
                finished.setdefault(name, {})[seed] = status[(name, seed)] = got
                log(f"[{name} s{seed}] already finished: {path}")
            else:
                todo.append((seed, name))
    skipped, unfinished = {}, []
    if todo:
        deadline = Deadline(started, args.max_minutes)
        data = ByteData(cfg)
        attention = pick_attention(args.attention, cfg)
        ref_model = GPT(cfg.d_model, cfg.layers, cfg.heads, cfg.seq, attention=attention)
        sample = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
        init = jax.jit(lambda k: ref_model.init(k, sample)["params"])
        params_of = functools.lru_cache(maxsize=1)(
            lambda seed: jax.device_get(init(jax.random.key(seed))))
        n_params = count_params(params_of(todo[0][0]))
        header = {
            "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax_version": jax.__version__, "flax_version": flax.__version__,
            "jax_fp8_version": getattr(jax_fp8, "__version__", None),
            "source_commit": args.source_commit or source_commit(),
            "preset": args.preset, "params": n_params,
            "tokens_per_step": cfg.batch * cfg.seq,
            "flops_per_token": flops_per_token(cfg, n_params), "attention": attention,
            "data": data.describe(), "tracked_tensors": [t[0] for t in tracked_tensors(cfg)],
            "probed_layers": [p[0] for p in probed_layers(cfg)]}
        log(f"{header['device']} ({header['backend']}), {n_params / 1e6:.2f}M params, "
            f"{header['tokens_per_step']:,} tokens/step, "
            f"{header['flops_per_token']['total'] / 1e6:.0f} MFLOP/token, data "
            f"{data.files['train']}+{data.files['val']} files ({data.train.size / 1e6:.1f}+"
            f"{data.val.size / 1e6:.1f} MB), attention {attention}; {len(todo)} runs to do")
        runs: dict[str, Run] = {}
        for seed, name in todo:
            if name in skipped:
                status[(name, seed)] = "skipped"
                continue
            if not deadline.allows(60.0):
                log(f"[{name} s{seed}] not started: --max-minutes leaves no time")
                unfinished.append([name, seed])
                continue
            params0 = params_of(seed)
            try:
                if name not in runs:
                    runs[name] = Run(name, cfg, params0, attention)
                ckpt_dir = ckpt_root / f"{name}_s{seed}"
                record, done = train_run(runs[name], seed, cfg, data, params0, ckpt_dir,
                                         args, deadline)
            except Skip as e:
                skipped[name] = (f"the library does not accept this recipe "
                                 f"({str(e).splitlines()[0][:300]})")
                log(f"[{name}] skipped: {skipped[name]}")
                status[(name, seed)] = "skipped"
                continue
            if not done:
                unfinished.append([name, seed])
                status[(name, seed)] = f"stopped at step {record['steps_done']}/{cfg.steps}"
                continue
            result = result_of(record, cfg, header)
            path = result_path(out, name, seed)
            write_json(path, result)
            shutil.rmtree(ckpt_dir, ignore_errors=True)
            if ckpt_root.is_dir() and not any(ckpt_root.iterdir()):
                ckpt_root.rmdir()
            finished.setdefault(name, {})[seed] = status[(name, seed)] = result
            log(f"[{name} s{seed}] wrote {path}")
    print(status_table(cfg, args.run_names, args.seeds, status))
    if unfinished and args.exit_code_unfinished:
        sys.exit(args.exit_code_unfinished)
    return {"finished": finished, "skipped": skipped, "unfinished": unfinished}


if __name__ == "__main__":
    main(started=_STARTED)
