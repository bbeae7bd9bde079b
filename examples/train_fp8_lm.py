"""Train a small character-level transformer LM with FP8 delayed scaling (jax_fp8 + Flax).

Every Dense of the attention (QKV, output projection) and of the MLP is an FP8 GEMM
(`jax_fp8.flax.Fp8DotGeneral`: E4M3 input and kernel, E5M2 gradients under the HYBRID
recipe); embeddings, layer norms, the attention score/value products and the LM head stay
in the compute dtype, as in Transformer Engine. The whole model's FP8 state is updated by
ONE fused ``jax_fp8.update_states`` call per step (`Fp8TrainState.apply_gradients`), and
the optimizer (AdamW with gradient clipping) never sees it.

    python examples/train_fp8_lm.py --steps 300 --out runs/fp8 --compare

(defaults: d_model 128, 2 layers, seq 64, batch 16 on CPU -- about 4 minutes on 2 cores
with --compare; d_model 256, 4 layers, seq 256, batch 32 on a GPU.)

--compare also trains the same model (same initial weights, same batches) without FP8
and reports the loss gap. Writes DIR/metrics.json ("loss", "reference_loss", the gap,
tokens/s, the tracked FP8 tensors' amax/scale) and, if matplotlib is installed,
DIR/loss.png and DIR/fp8_scaling.png. Runs on the GPU when JAX sees one, else on CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn

import jax_fp8
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState

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


def fp8_train_step(state: Fp8TrainState, batch):
    def loss_fn(params, fp8):
        return cross_entropy(state.apply_model(params, fp8, batch[:, :-1]), batch)

    loss, (grads, fp8_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params,
                                                                          state.fp8)
    return state.apply_gradients(grads=grads, fp8_grads=fp8_grads), loss


def ref_train_step(state, batch):
    def loss_fn(params):
        return cross_entropy(state.apply_fn({"params": params}, batch[:, :-1]), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


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


def progress(tag, step, steps, loss, tok_s, done=False):
    msg = f"\r[{tag}] step {step:5d}/{steps}  loss {loss:7.4f}  {tok_s:10,.0f} tok/s"
    sys.stderr.write(msg + ("\n" if done else ""))
    sys.stderr.flush()


def run(args, data, params0, model, tag, fp8_vars=None, recipe=None):
    tx = make_optimizer(args.lr, args.steps, args.warmup)
    # Fresh copies: the step donates its state, and both runs start from the same weights.
    params0, fp8_vars = jax.device_put(jax.device_get((params0, fp8_vars)))
    if fp8_vars is not None:
        state = Fp8TrainState.create(apply_fn=model.apply, params=params0, fp8=fp8_vars, tx=tx,
                                     recipe=recipe)
        step_fn = jax.jit(fp8_train_step, donate_argnums=(0,))
    else:
        from flax.training import train_state
        state = train_state.TrainState.create(apply_fn=model.apply, params=params0, tx=tx)
        step_fn = jax.jit(ref_train_step, donate_argnums=(0,))
    batches = data.batches(args.batch)
    tokens_per_step = args.batch * args.seq_len
    losses, track = [], {}
    tracked = tracked_tensors(args.layers) if fp8_vars is not None else []
    t_start = time.perf_counter()
    t_compiled = None
    every = max(1, args.steps // 100)
    for step in range(args.steps):
        batch = jnp.asarray(next(batches))
        state, loss = step_fn(state, batch)
        if fp8_vars is not None:
            # The newest amax sits at the end of each history after the update.
            for label, path in tracked:
                st = _state_at(jax_fp8.unpack_states(state.fp8), path)
                # (a new array: the state's own buffers are donated to the next step)
                track.setdefault(label, []).append(jnp.stack([st.amax_history[-1], st.scale]))
        losses.append(loss)
        if step == 0:
            jax.block_until_ready(loss)
            t_compiled = time.perf_counter()
        if (step + 1) % every == 0 or step + 1 == args.steps:
            current = float(loss)
            elapsed = time.perf_counter() - t_compiled
            tok_s = tokens_per_step * step / elapsed if step and elapsed > 0 else 0.0
            progress(tag, step + 1, args.steps, current, tok_s, done=step + 1 == args.steps)
    jax.block_until_ready(state)
    t_end = time.perf_counter()
    losses = [float(x) for x in jax.device_get(losses)]
    steady = args.steps - 1
    tok_s = tokens_per_step * steady / (t_end - t_compiled) if steady > 0 else float("nan")
    track = {k: {"amax": [float(a) for a, _ in np.asarray(jax.device_get(v))],
                 "scale": [float(s) for _, s in np.asarray(jax.device_get(v))]}
             for k, v in track.items()}
    # Held-out loss (a few batches, same for both runs).
    if fp8_vars is not None:
        def eval_loss(b):
            return cross_entropy(model.apply(state.variables(), b[:, :-1]), b)
    else:
        def eval_loss(b):
            return cross_entropy(model.apply({"params": state.params}, b[:, :-1]), b)
    valid = float("nan")
    if args.eval_batches > 0:
        eval_fn = jax.jit(eval_loss)
        vb = data.batches(args.batch, "valid", seed=12345)
        valid = float(np.mean([float(eval_fn(jnp.asarray(next(vb))))
                               for _ in range(args.eval_batches)]))
    return dict(loss=losses, tokens_per_s=tok_s, compile_s=t_compiled - t_start,
                total_s=t_end - t_start, valid_loss=valid, track=track)


def plot(out, metrics, args):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots", file=sys.stderr)
        return []
    written = []

    def smooth(v, k=max(1, args.steps // 50)):
        v = np.asarray(v)
        if k <= 1 or len(v) < k:
            return np.arange(len(v)), v
        c = np.convolve(v, np.ones(k) / k, mode="valid")
        return np.arange(k - 1, len(v)), c

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(*smooth(metrics["loss"]), label=f"FP8 ({args.format})")
    if "reference_loss" in metrics:
        ax.plot(*smooth(metrics["reference_loss"]), label=f"reference ({metrics['dtype']})",
                linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/char, smoothed)")
    ax.set_title(f"char LM d={args.d_model} L={args.layers} T={args.seq_len} B={args.batch}")
    ax.legend()
    ax.grid(alpha=0.3)
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
        axes[1].set_title("quantization scale (fp8_max / amax over history)")
        for a in axes:
            a.set_xlabel("step")
            a.grid(alpha=0.3)
        axes[1].legend(fontsize=8)
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
                    help="held-out batches for the final validation loss (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    for name, cpu_default, gpu_default in (("d_model", 128, 256), ("layers", 2, 4),
                                           ("seq_len", 64, 256), ("batch", 16, 32)):
        if getattr(args, name) is None:
            setattr(args, name, gpu_default if gpu else cpu_default)
    if args.d_model % args.heads:
        ap.error("--d-model must be divisible by --heads")
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

    fp8_run = run(args, data, params0, fp8_model, "fp8", fp8_vars=fp8_0, recipe=recipe)
    metrics = {"config": {k: v for k, v in vars(args).items()}, "backend": backend,
               "device": jax.devices()[0].device_kind, "dtype": dtype,
               "jax_version": jax.__version__, "n_params": int(n_params),
               "n_fp8_tensors": n_fp8, "loss": fp8_run["loss"],
               "tokens_per_s": fp8_run["tokens_per_s"], "valid_loss": fp8_run["valid_loss"],
               "compile_s": fp8_run["compile_s"], "fp8_tracked": fp8_run["track"]}
    if args.compare:
        ref_run = run(args, data, params0, ref_model, "ref")
        metrics.update(reference_loss=ref_run["loss"],
                       reference_tokens_per_s=ref_run["tokens_per_s"],
                       reference_valid_loss=ref_run["valid_loss"])
        k = max(1, args.steps // 10)
        fp8_tail = float(np.mean(fp8_run["loss"][-k:]))
        ref_tail = float(np.mean(ref_run["loss"][-k:]))
        diff = np.asarray(fp8_run["loss"]) - np.asarray(ref_run["loss"])
        metrics["gap"] = {
            "window_steps": k,
            "fp8_final_loss": fp8_tail, "reference_final_loss": ref_tail,
            "abs": fp8_tail - ref_tail, "rel": (fp8_tail - ref_tail) / ref_tail,
            "max_abs_per_step": float(np.max(np.abs(diff))),
            "mean_abs_per_step_second_half": float(np.mean(np.abs(diff[len(diff) // 2:]))),
            "valid_abs": fp8_run["valid_loss"] - ref_run["valid_loss"],
        }
    with open(out / "metrics.json", "w") as f:
        json.dump(metrics, f, indent=1)
    plots = plot(out, metrics, args)
    summary = (f"FP8 final loss {np.mean(fp8_run['loss'][-max(1, args.steps // 10):]):.4f} "
               f"(valid {fp8_run['valid_loss']:.4f}), {fp8_run['tokens_per_s']:,.0f} tok/s")
    if args.compare:
        g = metrics["gap"]
        summary += (f"; reference {g['reference_final_loss']:.4f} "
                    f"(valid {metrics['reference_valid_loss']:.4f}); "
                    f"gap {g['abs']:+.4f} ({100 * g['rel']:+.2f}%) over the last "
                    f"{g['window_steps']} steps")
    print(summary)
    print(f"wrote {out / 'metrics.json'}" + "".join(f", {p}" for p in plots))
    return metrics


if __name__ == "__main__":
    main()
