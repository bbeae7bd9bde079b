"""Train a small NNX character-level transformer LM, made FP8 in one call (jax_fp8 + Flax NNX).

The model is written with Flax's own NNX layers only (``nnx.Embed``,
``nnx.MultiHeadAttention``, ``nnx.Linear``, ``nnx.LayerNorm``), its blocks stacked by
``nnx.vmap`` and run by ``nnx.scan``. One call,

    jax_fp8.flax.fp8_model(model, [Fp8Rule(path="lm_head", recipe=None),
                                       Fp8Rule(recipe=recipe, min_fp8_flops=0)])

makes every projection of the attention and of the MLP an FP8 GEMM (the LM head and the
attention scores stay in float32) and gives each layer its FP8 state. The train step
differentiates the parameters and the FP8 state (`fp8_value_and_grad`) and applies both
(`apply_gradients`: the optimizer, and ONE fused update of the whole model's FP8 state).

    pip install ".[examples]"
    python examples/train_fp8_nnx.py --out runs/fp8_nnx

(defaults: d_model 64, 2 layers, seq 64, batch 16, delayed scaling: about a minute on
2 CPU cores.) The script prints the number of FP8 GEMM layers the conversion made (and
on a GPU the FP8 GEMMs of the compiled train step), a line every 10 % of the steps, and
the final train and validation losses; it writes DIR/metrics.json (losses per step,
validation loss, those counts, the amax history of one FP8 tensor) and nothing else.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_fp8
from jax_fp8.devtools import hlo
from jax_fp8.flax import Fp8Rule, fp8_model, nnx as fnnx

DEFAULT_CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "corpus.txt"
RECIPES = {"delayed": lambda a: jax_fp8.DelayedScaling(history_len=a.history_len),
           "current": lambda a: jax_fp8.Float8CurrentScaling(),
           "block": lambda a: jax_fp8.Float8BlockScaling()}


# ----------------------------------------------------------------------------- model

class Block(nnx.Module):
    """Pre-LN transformer block of plain Flax NNX layers (nothing FP8 in it)."""

    def __init__(self, d_model: int, n_heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=n_heads, in_features=d_model,
                                                decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x):
        causal = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attention(self.ln1(x), mask=causal, deterministic=True)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class CharLM(nnx.Module):
    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int,
                 *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(d_model, n_heads, rngs=rngs)

        self.blocks = make_blocks(rngs)     # one module, every parameter with a layer axis
        self.ln = nnx.LayerNorm(d_model, rngs=rngs)
        self.lm_head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def layers(x, block):
            return block(x)

        return self.lm_head(self.ln(layers(x, self.blocks)))


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


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ----------------------------------------------------------------------------- train

def build(args, vocab: int):
    """The model, converted in one call, and its optimizer (``nnx.Param``s only)."""
    recipe = RECIPES[args.recipe](args)
    model = CharLM(vocab, args.d_model, args.layers, args.heads, args.seq_len,
                   rngs=nnx.Rngs(args.seed))
    rules = [Fp8Rule(path="lm_head", recipe=None),       # the LM head stays in float32
             # every other GEMM of a weight, however small (by default, min_fp8_flops
             # "auto" would keep this small model's GEMMs out of FP8, where it does not pay)
             Fp8Rule(recipe=recipe, min_fp8_flops=0)]
    model = fp8_model(model, rules)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.warmup_cosine_decay_schedule(
                         0.0, args.lr, min(20, args.steps // 2), args.steps),
                         weight_decay=0.01))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param), recipe


def make_steps(graphdef, recipe):
    """Pure train / eval steps on the split (model, optimizer) state."""

    def train_step(state, tokens, targets):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = fnnx.fp8_value_and_grad(
            lambda m: cross_entropy(m(tokens), targets))(model)
        fnnx.apply_gradients(model, optimizer, grads, recipe)   # ONE FP8 update
        return nnx.state((model, optimizer)), loss

    def eval_step(state, tokens, targets):
        model, _ = nnx.merge(graphdef, state)
        return cross_entropy(model(tokens), targets)

    return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)


def fp8_layers(model) -> int:
    """The FP8 GEMM modules the conversion gave the model (a stacked one counts once)."""
    return sum(isinstance(m, (fnnx.Fp8DotGeneral, fnnx.Fp8Einsum))
               for _, m in nnx.iter_modules(model))


def tracked_history(model):
    """The amax history of the first layer's MLP input (a delayed-scaling state)."""
    dg = model.blocks.up.dot_general
    if not isinstance(dg, fnnx.Fp8DotGeneral) or not hasattr(dg, "input"):
        return None
    return np.asarray(dg.input.get_value().amax_history[0]).tolist()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="runs/fp8_nnx")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
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
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    data = Corpus(pathlib.Path(args.corpus), args.seq_len)
    model, optimizer, recipe = build(args, data.vocab)
    n_fp8 = len(jax.tree.leaves(fnnx.fp8_state(model)))
    graphdef, state = nnx.split((model, optimizer))
    train_step, eval_step = make_steps(graphdef, recipe)

    rng = np.random.default_rng(args.seed)
    tokens, targets = data.batch(rng, args.batch)
    compiled = train_step.lower(state, tokens, targets).compile()
    n_layers = fp8_layers(model)
    # XLA:GPU runs FP8 GEMMs (cuBLASLt); XLA:CPU widens FP8 operands before its dots.
    fp8_gemms = hlo.fp8_gemms(compiled) if jax.default_backend() == "gpu" else None
    print(f"{args.recipe} scaling: {n_layers} FP8 GEMM layers (x {args.layers} stacked), "
          f"{n_fp8} FP8 state arrays"
          + (f", FP8 GEMMs in the compiled step: {fp8_gemms}" if fp8_gemms else ""),
          flush=True)

    valid_rng = np.random.default_rng(args.seed + 1)
    valid = [data.batch(valid_rng, args.batch, "valid") for _ in range(args.eval_batches)]
    losses, start = [], time.perf_counter()
    every = max(1, args.steps // 10)
    for step in range(1, args.steps + 1):
        state, loss = compiled(state, tokens, targets)
        losses.append(float(loss))
        tokens, targets = data.batch(rng, args.batch)
        if step % every == 0 or step == args.steps:
            print(f"step {step}/{args.steps} loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    valid_loss = float(np.mean([eval_step(state, *b) for b in valid]))
    final_train = float(np.mean(losses[-max(1, args.steps // 10):]))
    nnx.update((model, optimizer), state)
    if isinstance(recipe, jax_fp8.DelayedScaling):
        fnnx.check_fp8_updated(model)        # the FP8 state did change during training
    print(f"final train loss {final_train:.4f} (mean of the last 10 % of steps), "
          f"valid loss {valid_loss:.4f}")

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = {"recipe": args.recipe, "loss": losses, "final_train_loss": final_train,
               "valid_loss": valid_loss, "fp8_layers": n_layers, "fp8_gemms": fp8_gemms,
               "n_fp8_arrays": n_fp8,
               "amax_history": tracked_history(model), "args": vars(args)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
    return metrics


if __name__ == "__main__":
    main()
