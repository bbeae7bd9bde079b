"""Train a small character-level transformer LM with FP8 delayed scaling (jax_fp8 + Flax).

Every Dense of the attention (QKV, output projection) and of the MLP is an FP8 GEMM
(`jax_fp8.flax.Fp8DotGeneral`: E4M3 input and kernel, E5M2 gradients under the HYBRID
recipe); embeddings, layer norms, the attention score/value products and the LM head stay
in the compute dtype, as in Transformer Engine. The whole model's FP8 state is updated by
ONE fused ``jax_fp8.update_states`` call per step (`Fp8TrainState.apply_gradients`), and
the optimizer (AdamW with gradient clipping) never sees it.

    pip install ".[examples]"          # or ".[test]": flax, optax, matplotlib, tqdm
    python examples/train_fp8_lm.py --steps 300 --out runs/fp8_lm --compare

(defaults: d_model 128, 2 layers, seq 64, batch 16 on CPU -- a few minutes on 2 cores
with --compare; d_model 256, 4 layers, seq 256, batch 32 on a GPU.)

--compare also trains the same model (same initial weights, same batches) without FP8.
Each run shows a progress bar (a line every 10 % when stderr is not a terminal) and is
evaluated every --eval-every steps on the same held-out batches. At the end the script
prints each run's final train loss (mean of the last 10 % of steps) and validation loss,
and the relative gap. Everything goes under --out (nothing else is written): DIR/metrics.json
("loss", "reference_loss", "valid_curve", "final", the gap, tokens/s, the tracked FP8
tensors' amax/scale) and, if matplotlib is installed, DIR/loss.png (train and validation
loss; with --compare also FP8 minus the reference) and DIR/fp8_scaling.png. Runs on the
GPU when JAX sees one, else on CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_fp8
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState

try:
    from tqdm.auto import tqdm
except ImportError:  # progress lines instead of a bar
    tqdm = None

DEFAULT_CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "corpus.txt"


# ----------------------------------------------------------------------------- model

class Block(nn.Module):
    d_model: int
    n_heads: int
    dtype: jnp.dtype
    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        dense = functools.partial(nn.Dense, dtype=self.dtype,
                                  dot_general_cls=self.dot_general_cls)
        h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
        qkv = dense(3 * d, use_bias=False, name="qkv")(h)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, self.n_heads, d // self.n_heads), 3, axis=2)
        q, k, v = (a[:, :, 0] for a in (q, k, v))                    # [b, t, heads, hd]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        logits = logits / math.sqrt(d // self.n_heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
        attn = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        x = x + dense(d, name="attn_out")(o)
        h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
        h = nn.gelu(dense(4 * d, name="mlp_in")(h))
        return x + dense(d, name="mlp_out")(h)


class CharLM(nn.Module):
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    dtype: jnp.dtype
    dot_general_cls: object = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model))
        x = x + pos[: tokens.shape[1]].astype(self.dtype)
        for i in range(self.n_layers):
            x = Block(self.d_model, self.n_heads, self.dtype, self.dot_general_cls,
                      name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return nn.Dense(self.vocab, dtype=jnp.float32, name="head")(x)


# ----------------------------------------------------------------------------- data

class CharData:
    def __init__(self, text: str, seq_len: int, seed: int):
        chars = sorted(set(text))
        self.itos = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        data = np.array([self.stoi[c] for c in text], dtype=np.int32)
        split = int(0.95 * len(data))
        self.train, self.valid = data[:split], data[split:]
        self.seq_len = seq_len
        self.seed = seed

    @property
    def vocab(self):
        return len(self.itos)

    def batches(self, batch: int, split: str = "train", seed: int | None = None):
        data = self.train if split == "train" else self.valid
        rng = np.random.default_rng(self.seed if seed is None else seed)
        idx = np.arange(self.seq_len + 1)
        while True:
            starts = rng.integers(0, len(data) - self.seq_len - 1, size=batch)
            yield data[starts[:, None] + idx]


# ----------------------------------------------------------------------------- training

def cross_entropy(logits, batch):
    targets = batch[:, 1:]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_optimizer(lr, steps, warmup):
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, max(steps - 1, 1)),
                                               max(steps, 2), end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1))


def tracked_tensors(n_layers):
    """A few FP8 states to plot: (label, path into the fp8 collection)."""
    last = f"block_{n_layers - 1}"
    return [("block_0/qkv input", ("block_0", "qkv", "input")),
            ("block_0/qkv kernel", ("block_0", "qkv", "kernel")),
            ("block_0/qkv grad", ("block_0", "qkv", "grad")),
            (f"{last}/mlp_out grad", (last, "mlp_out", "grad"))]


def _state_at(fp8, path):
    block, layer, name = path
    return fp8[block][layer]["Fp8DotGeneral_0"][name]


def fp8_train_step(state: Fp8TrainState, batch, tracked=()):
    def loss_fn(params, fp8):
        return cross_entropy(state.apply_model(params, fp8, batch[:, :-1]), batch)

    loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params,
                                                                          state.fp8)
    new = state.apply_gradients(grads=grads, fp8_grads=fp8_grads)
    # The newest amax sits at the end of each history after the update.
    states = jax_fp8.unpack_states(new.fp8)
    track = jnp.stack([jnp.stack([_state_at(states, path).amax_history[-1],
                                  _state_at(states, path).scale]) for _, path in tracked])
    return new, loss, track


def ref_train_step(state, batch):
    def loss_fn(params):
        return cross_entropy(state.apply_fn({"params": params}, batch[:, :-1]), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss, jnp.zeros((0, 2))


class Progress:
    """One bar per run (tqdm) on a terminal; a line every 10 % of the steps otherwise."""

    def __init__(self, tag: str, total: int):
        self.tag, self.total = tag, total
        self.bar = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=tag, unit="step", dynamic_ncols=True,
                            file=sys.stderr)
        self.every, self.last = max(1, total // 10), 0

    def update(self, n: int, **postfix):
        text = "  ".join(f"{k} {v}" for k, v in postfix.items())
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            self.bar.set_postfix_str(text, refresh=True)
        elif n - self.last >= self.every or n == self.total:
            print(f"[{self.tag}] step {n}/{self.total}  {text}", file=sys.stderr, flush=True)
            self.last = n

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run(args, data, variables, model, tag, recipe=None):
    """Trains one model; variables holds "params" (and "fp8_meta" for the FP8 run)."""
    tx = make_optimizer(args.lr, args.steps, args.warmup)
    # Fresh copies: the step donates its state, and both runs start from the same weights.
    variables = jax.device_put(jax.device_get(variables))
    fp8 = "fp8_meta" in variables
    tracked = tracked_tensors(args.layers) if fp8 else []
    if fp8:
        state = Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=tx,
                                     recipe=recipe)
        step_fn = jax.jit(functools.partial(fp8_train_step, tracked=tracked),
                          donate_argnums=(0,))

        def eval_loss(state, b):
            return cross_entropy(model.apply(state.variables(), b[:, :-1]), b)
    else:
        from flax.training import train_state
        state = train_state.TrainState.create(apply_fn=model.apply,
                                              params=variables["params"], tx=tx)
        step_fn = jax.jit(ref_train_step, donate_argnums=(0,))

        def eval_loss(state, b):
            return cross_entropy(model.apply({"params": state.params}, b[:, :-1]), b)
    eval_fn = jax.jit(eval_loss)
    # The same held-out batches for every evaluation of both runs.
    vb = data.batches(args.batch, "valid", seed=12345)
    valid_batches = [jnp.asarray(next(vb)) for _ in range(args.eval_batches)]
    valid_steps, valid_curve = [], []

    def evaluate(step):
        if valid_batches:
            losses = jax.device_get([eval_fn(state, b) for b in valid_batches])
            valid_steps.append(step)
            valid_curve.append(float(np.mean(losses)))

    batches = data.batches(args.batch)
    tokens_per_step = args.batch * args.seq_len
    losses, track = [], []
    t_start = time.perf_counter()
    t_compiled = None
    train_s = 0.0             # step time after the first (compiling) step, evals excluded
    every = max(1, args.steps // 100)
    bar = Progress(tag, args.steps)
    t_seg = None
    for step in range(args.steps):
        if t_seg is None and t_compiled is not None:
            t_seg = time.perf_counter()
        batch = jnp.asarray(next(batches))
        state, loss, tr = step_fn(state, batch)
        losses.append(loss)
        track.append(tr)
        if step == 0:
            jax.block_until_ready(loss)
            t_compiled = time.perf_counter()
        done = step + 1
        do_eval = done % args.eval_every == 0 or done == args.steps
        if done % every == 0 or do_eval:
            current = float(loss)             # waits for the step
            if t_seg is not None:
                train_s += time.perf_counter() - t_seg
                t_seg = None
            if do_eval:
                evaluate(done)
            tok_s = tokens_per_step * step / train_s if train_s > 0 else 0.0
            postfix = {"loss": f"{current:.4f}"}
            if valid_curve:
                postfix["val"] = f"{valid_curve[-1]:.4f}"
            postfix["tok/s"] = f"{tok_s:,.0f}"
            bar.update(done, **postfix)
    bar.close()
    jax.block_until_ready(state)
    t_end = time.perf_counter()
    losses = [float(x) for x in jax.device_get(losses)]
    steady = args.steps - 1
    tok_s = tokens_per_step * steady / train_s if steady > 0 and train_s > 0 else float("nan")
    track = np.asarray(jax.device_get(track), np.float64)        # [steps, tensors, 2]
    track = {label: {"amax": track[:, i, 0].tolist(), "scale": track[:, i, 1].tolist()}
             for i, (label, _) in enumerate(tracked)}
    k = max(1, args.steps // 10)
    return dict(loss=losses, tokens_per_s=tok_s, compile_s=t_compiled - t_start,
                total_s=t_end - t_start, valid_loss=valid_curve[-1] if valid_curve else
                float("nan"), valid_steps=valid_steps, valid_curve=valid_curve,
                final_train_loss=float(np.mean(losses[-k:])), track=track)


def _matplotlib(out: pathlib.Path):
    """pyplot, with matplotlib's config/font cache in a temporary folder under `out`
    (removed by `_matplotlib_done`), or None when matplotlib is not installed."""
    tmp = None
    if "MPLCONFIGDIR" not in os.environ and "matplotlib" not in sys.modules:
        tmp = tempfile.mkdtemp(prefix=".matplotlib-", dir=out)
        os.environ["MPLCONFIGDIR"] = tmp
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    return plt, tmp


def _matplotlib_done(tmp):
    if tmp is not None:
        if os.environ.get("MPLCONFIGDIR") == tmp:
            del os.environ["MPLCONFIGDIR"]
        shutil.rmtree(tmp, ignore_errors=True)


def plot(out, metrics, args):
    """loss.png (train and validation loss of each run) and fp8_scaling.png."""
    plt, tmp = _matplotlib(out)
    try:
        if plt is None:
            print("matplotlib is not installed: skipping plots", file=sys.stderr)
            return []
        return _plot(plt, out, metrics, args)
    finally:
        _matplotlib_done(tmp)


def _plot(plt, out, metrics, args):
    written = []

    def smooth(v, k=max(1, args.steps // 50)):  # noqa: B008 (an int, fixed for this plot)
        v = np.asarray(v)
        if k <= 1 or len(v) < k:
            return np.arange(len(v)), v
        c = np.convolve(v, np.ones(k) / k, mode="valid")
        return np.arange(k - 1, len(v)), c

    compare = "reference_loss" in metrics
    if compare:   # the losses, and below them FP8 - reference (the curves above overlap)
        fig, (ax, gap_ax) = plt.subplots(2, 1, figsize=(7, 6.4), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2))
    runs = [("FP8 (" + args.format + ")", "", "C0")]
    if compare:
        runs.append((f"reference ({metrics['dtype']})", "reference_", "C1"))
    for label, prefix, color in runs:
        ax.plot(*smooth(metrics[prefix + "loss"]), color=color, lw=1.2,
                label=f"{label} train (smoothed)")
        curve = metrics[prefix + "valid_curve"]
        if curve["loss"]:
            ax.plot(curve["steps"], curve["loss"], color=color, ls="--", marker="o", ms=3,
                    label=f"{label} validation")
    ax.set_ylabel("loss (nats/char)")
    ax.set_title(f"char LM d={args.d_model} L={args.layers} T={args.seq_len} B={args.batch}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if compare:
        # Both runs see the same batches from the same weights, so the difference at each
        # step is FP8's effect (and the runs' drift apart), not batch noise.
        diff = np.asarray(metrics["loss"]) - np.asarray(metrics["reference_loss"])
        gap_ax.axhline(0.0, color="black", lw=0.8)
        gap_ax.plot(np.arange(len(diff)), diff, color="C2", lw=0.6, alpha=0.35,
                    label="train, per step")
        k = max(1, args.steps // 20)
        gap_ax.plot(*smooth(diff, k), color="C2", lw=1.4, label=f"train, mean of {k} steps")
        fp8_v, ref_v = metrics["valid_curve"], metrics["reference_valid_curve"]
        if fp8_v["loss"] and fp8_v["steps"] == ref_v["steps"]:
            gap_ax.plot(fp8_v["steps"], np.asarray(fp8_v["loss"]) - np.asarray(ref_v["loss"]),
                        color="C3", ls="--", marker="o", ms=3, label="validation")
        rel = metrics["final"]["rel_gap"]
        gap_ax.set_title(f"FP8 - reference; final relative gap: train {100 * rel['train']:+.2f} %"
                         f", validation {100 * rel['valid']:+.2f} %", fontsize=9)
        gap_ax.set_ylabel("loss difference (nats/char)")
        gap_ax.legend(fontsize=8)
        gap_ax.grid(alpha=0.3)
        gap_ax.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    written.append(out / "loss.png")

    track = metrics.get("fp8_tracked", {})
    if track:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for label, series in track.items():
            axes[0].semilogy(series["amax"], label=label)
            axes[1].semilogy(series["scale"], label=label)
        axes[0].set_title("newest amax per step")
        axes[0].set_ylabel("amax (largest |value| this step)")
        axes[1].set_title("quantization scale (fp8_max / amax over history)")
        axes[1].set_ylabel("scale")
        for a in axes:
            a.set_xlabel("step")
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "fp8_scaling.png", dpi=120)
        plt.close(fig)
        written.append(out / "fp8_scaling.png")
    return written


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/fp8_lm")
    # Sizes default by backend: a few minutes on 2 CPU cores, a larger model on a GPU.
    ap.add_argument("--d-model", type=int, default=None, help="default: 128 CPU, 256 GPU")
    ap.add_argument("--layers", type=int, default=None, help="default: 2 CPU, 4 GPU")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=None, help="default: 64 CPU, 256 GPU")
    ap.add_argument("--batch", type=int, default=None, help="default: 16 CPU, 32 GPU")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--history-len", type=int, default=16)
    ap.add_argument("--format", choices=["HYBRID", "E4M3"], default="HYBRID")
    ap.add_argument("--margin", type=float, default=0.0)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="compute dtype of both runs (auto: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--compare", action="store_true",
                    help="also train the same model without FP8 and store its losses")
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--eval-batches", type=int, default=4,
                    help="held-out batches of each validation loss (0: no validation)")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="validation loss every this many steps (default: steps // 10)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    for name, cpu_default, gpu_default in (("d_model", 128, 256), ("layers", 2, 4),
                                           ("seq_len", 64, 256), ("batch", 16, 32)):
        if getattr(args, name) is None:
            setattr(args, name, gpu_default if gpu else cpu_default)
    if args.d_model % args.heads:
        ap.error("--d-model must be divisible by --heads")
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 10)
    if args.eval_every < 1:
        ap.error("--eval-every must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = jax.default_backend()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if backend == "gpu" else "float32")
    text = pathlib.Path(args.corpus).read_text(encoding="utf-8")
    data = CharData(text, args.seq_len, args.seed)
    recipe = jax_fp8.DelayedScaling(history_len=args.history_len, margin=args.margin,
                                    fp8_format=jax_fp8.Format[args.format])
    dg = functools.partial(Fp8DotGeneral, recipe=recipe)
    fp8_model = CharLM(data.vocab, args.d_model, args.layers, args.heads, args.seq_len,
                       jnp.dtype(dtype), dg)
    ref_model = fp8_model.clone(dot_general_cls=None)
    sample = jnp.zeros((args.batch, args.seq_len), jnp.int32)
    variables = jax.jit(fp8_model.init)(jax.random.key(args.seed), sample)
    params0, fp8_0 = variables["params"], variables["fp8_meta"]
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    n_fp8 = len([x for x in jax.tree.leaves(fp8_0, is_leaf=lambda s: isinstance(
        s, jax_fp8.ScalingState)) if isinstance(x, jax_fp8.ScalingState)])
    print(f"backend={backend} ({jax.devices()[0].device_kind}) dtype={dtype} "
          f"params={n_params:,} fp8 tensors={n_fp8} vocab={data.vocab} "
          f"recipe={args.format} L={args.history_len}", file=sys.stderr)

    fp8_run = run(args, data, variables, fp8_model, "fp8", recipe=recipe)
    metrics = {"config": {k: v for k, v in vars(args).items()}, "backend": backend,
               "device": jax.devices()[0].device_kind, "dtype": dtype,
               "jax_version": jax.__version__, "n_params": int(n_params),
               "n_fp8_tensors": n_fp8, "loss": fp8_run["loss"],
               "tokens_per_s": fp8_run["tokens_per_s"], "valid_loss": fp8_run["valid_loss"],
               "valid_curve": {"steps": fp8_run["valid_steps"],
                               "loss": fp8_run["valid_curve"]},
               "compile_s": fp8_run["compile_s"], "fp8_tracked": fp8_run["track"]}
    k = max(1, args.steps // 10)
    final = {"train_window_steps": k, "valid_batches": args.eval_batches,
             "fp8": {"train_loss": fp8_run["final_train_loss"],
                     "valid_loss": fp8_run["valid_loss"]}}
    if args.compare:
        ref_run = run(args, data, {"params": variables["params"]}, ref_model, "reference")
        metrics.update(reference_loss=ref_run["loss"],
                       reference_tokens_per_s=ref_run["tokens_per_s"],
                       reference_valid_loss=ref_run["valid_loss"],
                       reference_valid_curve={"steps": ref_run["valid_steps"],
                                              "loss": ref_run["valid_curve"]})
        fp8_tail, ref_tail = fp8_run["final_train_loss"], ref_run["final_train_loss"]
        diff = np.asarray(fp8_run["loss"]) - np.asarray(ref_run["loss"])
        metrics["gap"] = {
            "window_steps": k,
            "fp8_final_loss": fp8_tail, "reference_final_loss": ref_tail,
            "abs": fp8_tail - ref_tail, "rel": (fp8_tail - ref_tail) / ref_tail,
            "max_abs_per_step": float(np.max(np.abs(diff))),
            "mean_abs_per_step_second_half": float(np.mean(np.abs(diff[len(diff) // 2:]))),
            "valid_abs": fp8_run["valid_loss"] - ref_run["valid_loss"],
            "valid_rel": (fp8_run["valid_loss"] - ref_run["valid_loss"])
            / ref_run["valid_loss"],
        }
        final["reference"] = {"train_loss": ref_tail, "valid_loss": ref_run["valid_loss"]}
        final["rel_gap"] = {"train": metrics["gap"]["rel"], "valid": metrics["gap"]["valid_rel"]}
    metrics["final"] = final
    with open(out / "metrics.json", "w") as f:
        json.dump(metrics, f, indent=1)
    plots = plot(out, metrics, args)

    print(f"final losses (train: mean of the last {k} steps; validation: "
          f"{args.eval_batches} held-out batches of {args.batch})")
    rows = [("fp8", fp8_run)] + ([("reference", ref_run)] if args.compare else [])
    for name, r in rows:
        print(f"  {name:10s} train {r['final_train_loss']:.4f}  valid {r['valid_loss']:.4f}"
              f"  {r['tokens_per_s']:,.0f} tok/s")
    if args.compare:
        g = final["rel_gap"]
        print(f"  relative gap (fp8 - reference) / reference: train {100 * g['train']:+.2f} %,"
              f" valid {100 * g['valid']:+.2f} %")
    print(f"wrote {out / 'metrics.json'}" + "".join(f", {p}" for p in plots))
    return metrics


if __name__ == "__main__":
    main()
