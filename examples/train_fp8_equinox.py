"""Train a small Equinox character-level transformer LM in FP8, next to the same model in float32.

The model is written as Equinox's examples write one: modules called on one sequence
(``eqx.nn.MultiheadAttention``, ``eqx.nn.Linear`` / ``eqx.nn.LayerNorm`` ``jax.vmap``-ed over
its positions), its blocks stacked by ``eqx.filter_vmap`` and run by ``jax.lax.scan``, the
loss ``jax.vmap``-ing the model over the batch. One call,

    jax_fp8.equinox.fp8_model(model, [Fp8Rule(path="lm_head", recipe=None),
                                      Fp8Rule(path="", recipe=None),
                                      Fp8Rule(recipe=recipe, min_fp8_flops=0)])

makes every projection of the attention and of the MLP an FP8 GEMM (the LM head and the
attention scores stay in float32), each with its FP8 state (stacked over the layers). The
train step is Equinox's (``eqx.filter_jit``, ``eqx.filter_value_and_grad``, optax) over
``jax_fp8.equinox.params`` and ``jax_fp8.equinox.apply_updates`` (the optimizer, and ONE
fused update of the whole model's FP8 state).

    pip install ".[equinox]"
    python examples/train_fp8_equinox.py --out runs/fp8_equinox

(defaults: d_model 64, 2 layers, seq 64, batch 16, delayed scaling, 300 steps, then the
same model and data in float32: a few CPU minutes.) It prints a line every 10 % of the
steps and each run's final train and validation losses, and writes DIR/metrics.json (both
runs' losses and the FP8 run's gap to float32) and nothing else. ``--no-compare`` trains
the FP8 model alone.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import jax_fp8
import jax_fp8.equinox as jfe
from jax_fp8 import Fp8Rule

DEFAULT_CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "corpus.txt"
RECIPES = {"delayed": lambda a: jax_fp8.DelayedScaling(history_len=a.history_len),
           "current": lambda a: jax_fp8.Float8CurrentScaling(),
           "block": lambda a: jax_fp8.Float8BlockScaling()}


# ----------------------------------------------------------------------------- model

class Block(eqx.Module):
    """Pre-LN transformer block of Equinox's own layers, on one sequence [seq, d_model]."""

    ln1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d_model, n_heads, *, key):
        attention_key, up_key, down_key = jr.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(d_model)
        self.attention = eqx.nn.MultiheadAttention(n_heads, d_model, key=attention_key)
        self.ln2 = eqx.nn.LayerNorm(d_model)
        self.up = eqx.nn.Linear(d_model, 4 * d_model, key=up_key)
        self.down = eqx.nn.Linear(4 * d_model, d_model, key=down_key)

    def __call__(self, x, mask):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.up)(jax.vmap(self.ln2)(x))
        return x + jax.vmap(self.down)(jax.nn.gelu(h))


class CharLM(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    blocks: Block
    ln: eqx.nn.LayerNorm
    lm_head: eqx.nn.Linear

    def __init__(self, vocab, d_model, n_layers, n_heads, seq_len, *, key):
        embed_key, pos_key, blocks_key, head_key = jr.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, d_model, key=embed_key)
        self.pos = 0.02 * jr.normal(pos_key, (seq_len, d_model))
        make = lambda k: Block(d_model, n_heads, key=k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make)(jr.split(blocks_key, n_layers))
        self.ln = eqx.nn.LayerNorm(d_model)
        self.lm_head = eqx.nn.Linear(d_model, vocab, key=head_key)

    def __call__(self, tokens):                      # tokens: [seq]
        x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
        mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x, dynamic_block):
            return eqx.combine(dynamic_block, static)(x, mask), None

        x, _ = jax.lax.scan(layer, x, dynamic)
        return jax.vmap(self.lm_head)(jax.vmap(self.ln)(x))


# ------------------------------------------------------------------------------ data

class Corpus:
    def __init__(self, path: pathlib.Path, seq_len: int):
        text = path.read_text(encoding="utf-8")
        chars = sorted(set(text))
        self.vocab = len(chars)
        ids = np.array([chars.index(c) for c in text], dtype=np.int32)
        cut = int(0.9 * len(ids))
        self.split = {"train": ids[:cut], "valid": ids[cut:]}
        self.seq_len = seq_len

    def batch(self, rng: np.random.Generator, size: int, split: str = "train"):
        ids = self.split[split]
        starts = rng.integers(0, len(ids) - self.seq_len - 1, size)
        window = np.stack([ids[s:s + self.seq_len + 1] for s in starts])
        return jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:])


def loss_fn(model, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ----------------------------------------------------------------------------- train

def train(args, data: Corpus, fp8: bool) -> dict:
    """One run: the FP8 model (converted in one call) or the same model in float32."""
    model = CharLM(data.vocab, args.d_model, args.layers, args.heads, args.seq_len,
                   key=jr.key(args.seed))
    if fp8:
        rules = [Fp8Rule(path="lm_head", recipe=None),    # the LM head stays in float32
                 # CharLM's own array (the positions) is added, never a GEMM's operand
                 Fp8Rule(path="", recipe=None),
                 # every other GEMM of a weight, however small (min_fp8_flops "auto" would
                 # keep this small model's GEMMs out of FP8, where it does not pay)
                 Fp8Rule(recipe=RECIPES[args.recipe](args), min_fp8_flops=0)]
        model = jfe.fp8_model(model, rules)
    optim = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.adamw(optax.warmup_cosine_decay_schedule(
                            0.0, args.lr, min(20, args.steps // 2), args.steps),
                            weight_decay=0.01))
    opt_state = optim.init(jfe.params(model))

    @eqx.filter_jit(donate="all-except-first")
    def train_step(model, opt_state, tokens, targets):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, targets)
        updates, opt_state = optim.update(jfe.params(grads), opt_state, jfe.params(model))
        return jfe.apply_updates(model, updates, grads, opt_state=opt_state), opt_state, loss

    eval_loss = eqx.filter_jit(loss_fn)
    name = f"fp8 ({args.recipe})" if fp8 else "float32"
    rng = np.random.default_rng(args.seed)
    valid_rng = np.random.default_rng(args.seed + 1)
    valid = [data.batch(valid_rng, args.batch, "valid") for _ in range(args.eval_batches)]
    losses, start, every = [], time.perf_counter(), max(1, args.steps // 10)
    for step in range(1, args.steps + 1):
        model, opt_state, loss = train_step(model, opt_state, *data.batch(rng, args.batch))
        losses.append(float(loss))
        if step % every == 0 or step == args.steps:
            print(f"{name}: step {step}/{args.steps} loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    if fp8 and isinstance(RECIPES[args.recipe](args), jax_fp8.DelayedScaling):
        jfe.check_fp8_updated(model)      # the FP8 state did change during training
    result = {"loss": losses, "final_train_loss": float(np.mean(losses[-every:])),
              "valid_loss": float(np.mean([eval_loss(model, *b) for b in valid])),
              "fp8_states": len(jfe.fp8_states(model))}
    print(f"{name}: final train loss {result['final_train_loss']:.4f} (mean of the last "
          f"10 % of steps), valid loss {result['valid_loss']:.4f}", flush=True)
    return result


ap = argparse.ArgumentParser(description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--out", default="runs/fp8_equinox")
ap.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                help="also train the same model in float32 (default: yes)")
ap.add_argument("--d-model", type=int, default=64)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--seq-len", type=int, default=64)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--history-len", type=int, default=16)
ap.add_argument("--eval-batches", type=int, default=4)
ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
ap.add_argument("--seed", type=int, default=0)


def main(argv=None):
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    data = Corpus(pathlib.Path(args.corpus), args.seq_len)
    metrics = {"recipe": args.recipe, "fp8": train(args, data, fp8=True), "args": vars(args)}
    if args.compare:
        metrics["float32"] = train(args, data, fp8=False)
        gap = metrics["fp8"]["valid_loss"] / metrics["float32"]["valid_loss"] - 1
        metrics["valid_gap_to_float32"] = gap
        print(f"FP8 validation loss {100 * gap:+.2f} % of float32's", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
    return metrics


if __name__ == "__main__":
    main()
