"""Convergence of FP8 training against bf16: a byte-level GPT trained with several recipes.

The same decoder-only transformer is trained from the same initial weights on the same
batches, once per *run*; each run differs only in how the attention projections and MLP
Dense layers compute their GEMMs:

  bf16               plain nn.Dense, bf16 compute (the reference)
  jax_fp8_delayed    jax_fp8.flax.Fp8DotGeneral, DelayedScaling(HYBRID, history 1024):
                     E4M3 inputs and kernels, E5M2 gradients, one fused FP8-state update
                     per step (jax_fp8.flax.Fp8TrainState)
  flax_fp8           flax.linen.Fp8DirectDotGeneralOp (history 1024), its
                     "_overwrite_with_gradient" collection handled the usual Flax way
  jax_fp8_delayed_e4m3  the same with DelayedScaling(E4M3): E4M3 gradients too (3 mantissa
                     bits instead of E5M2's 2, range 448 times the scale)
  jax_fp8_current    Fp8DotGeneral with Float8CurrentScaling() (per-tensor, no state)
  jax_fp8_blockwise  Fp8DotGeneral with Float8BlockScaling() (E4M3, 1x128 / 128x128 blocks)

Each run is one entry of the RUNS table below (a recipe run is skipped, with a message,
when the installed jax_fp8 does not provide or accept its recipe).

Model: GPT-style, pre-LayerNorm, causal multi-head attention, GELU MLP (4x), learned
positions, untied LM head, vocabulary 256 (bytes). Parameters are float32; compute is
bf16. The qkv / attention-output / MLP-in / MLP-out Dense layers are the FP8 GEMMs; the
embeddings, the layer norms, the attention itself (jax.nn.dot_product_attention) and the
LM head stay in bf16 in every run, as in Transformer Engine.

Data: the Python standard library's own source files of the running interpreter
(``sysconfig.get_paths()["stdlib"]``, every ``*.py`` below it, sorted, ``site-packages``
excluded), read as bytes, split into train and validation *by file* with a fixed seed,
each file followed by a 0 byte. Batch ``s`` is ``batch`` windows of ``seq + 1`` bytes at
offsets drawn by ``numpy.random.default_rng([seed, 0, s])``: the same sequence for every
run and across resumes. Validation is a fixed set of windows of the validation files.
The initial weights are created once (float32, fixed key) and reused by every run.

Optimizer: AdamW (b1 0.9, b2 0.95, weight decay 0.1 on matrices), linear warmup then
cosine decay to 10 % of the peak, gradient clipping at global norm 1.0.

Recorded per run (``--out/results.json``, merged with what earlier processes wrote):
train loss every step, validation loss every ``--eval-every`` steps and at the end,
tokens/s (after ``--timing-warmup`` steps of each process, evaluation and checkpoint
time excluded), the newest amax and the scale of a few FP8 tensors every step, and every
``--probe-every`` steps, on a few layers, the fraction of the incoming gradient's nonzero
bf16 values that underflow to 0 when multiplied by the scale and cast to float8_e5m2 --
with the scale the run quantizes that gradient with in that step, where it has one
(delayed scaling), and with the per-tensor current scale ``57344 / amax(grad)`` (for
every run, bf16 included). The gradient is taken inside the train step itself (a zero
added to each probed Dense output; its cotangent is what the GEMM's backward receives),
the fractions computed under a ``lax.cond`` on probe steps only. Plots:
``--out/loss.png`` (train and validation loss) and ``--out/fp8.png`` (amax, scale,
underflow). Checkpoints (orbax) every ``--ckpt-every`` steps under ``--out/<run>/ckpt``.

Run it (one run per process, so each fits a time limit; ``--resume`` continues a run
from its latest checkpoint and does nothing for a finished one):

    python examples/convergence.py --preset smoke --out runs/conv_smoke   # CPU, seconds
    python examples/convergence.py --preset h200 --runs bf16 --out runs/conv --max-minutes 8.5
    python examples/convergence.py --preset h200 --runs bf16 --out runs/conv --resume --max-minutes 8.5
    python examples/convergence.py --preset h200 --runs jax_fp8_delayed --out runs/conv --max-minutes 8.5
    python examples/convergence.py --preset h200 --runs flax_fp8 --out runs/conv --max-minutes 8.5
    python examples/convergence.py --out runs/conv --plot-only   # the PNGs from results.json

``--max-minutes M`` stops before M minutes have passed since the script started: it
checkpoints, writes results.json and exits with status 0 (status 3 tells a caller that a
run is not finished yet: pass ``--exit-code-unfinished 3``).

Sizing of the h200 preset (d_model 1024, 8 layers, 16 heads, seq 1024, batch 48):
params N = 8 * 12 * 1024^2 (Dense kernels) + 1024 * 1024 (positions) + 2 * 256 * 1024
(embedding, head) + biases and norms = 102.3M. Training FLOPs per token =
6 N + 12 * layers * seq * d_model (attention scores and weighted sum, forward and
backward, causal half not skipped) = 614.1M + 100.7M = 714.7M. Tokens per step =
48 * 1024 = 49,152, so 35.1 TFLOP per step. bf16 at 35 % MFU of an H200's ~790 TFLOP/s
dense bf16 peak = 276.5 TFLOP/s: 0.127 s per step, 381 s (6.3 min) for 3,000 steps; with
compilation (~1 min), 31 evaluations of 8 batches (forward only, ~10 s) and 7
checkpoints of ~1.2 GB (~15 s): about 7.5-8 minutes for the bf16 run, less for the FP8
runs. (64 windows, 65,536 tokens/step, would already need 8.5 min of
steps alone.) 3,000 steps see 147M tokens, about 5 passes over the ~30 MB of training
bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from typing import Any, Callable

_STARTED = time.monotonic()   # --max-minutes counts from here (before the imports below)

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import fp8_ops as flax_fp8_ops
from flax.training import train_state

import jax_fp8
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState

try:
    from tqdm.auto import tqdm
except ImportError:  # progress lines instead of a bar
    tqdm = None

FP8_COLLECTION = "fp8_meta"
FLAX_OWG = getattr(flax_fp8_ops, "OVERWRITE_WITH_GRADIENT", "_overwrite_with_gradient")
FLAX_OP = getattr(flax_fp8_ops, "Fp8DirectDotGeneralOp", None)
FP8_LAYERS = ("qkv", "attn_out", "mlp_in", "mlp_out")


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass
class Config:
    # model
    d_model: int
    layers: int
    heads: int
    seq: int
    # training
    batch: int
    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    history_len: int = 1024
    seed: int = 0
    # data
    val_fraction: float = 0.05
    data_seed: int = 1234
    # measurement
    eval_every: int = 100
    eval_batches: int = 8
    probe_every: int = 100
    timing_warmup: int = 10
    # bookkeeping (not part of what makes runs comparable)
    ckpt_every: int = 500
    log_every: int = 10

    # Fields that runs merged into one results.json must share.
    COMPARABLE = ("d_model", "layers", "heads", "seq", "batch", "steps", "lr", "warmup",
                  "min_lr_ratio", "weight_decay", "clip", "history_len", "seed",
                  "val_fraction", "data_seed", "eval_every", "eval_batches", "probe_every")

    def comparable(self) -> dict:
        return {k: getattr(self, k) for k in self.COMPARABLE}


PRESETS = {
    # A tiny model: the same code path as h200, on CPU in seconds.
    "smoke": Config(d_model=64, layers=2, heads=2, seq=64, batch=4, steps=8, lr=3e-3,
                    warmup=2, eval_every=4, eval_batches=2, probe_every=4, timing_warmup=1,
                    ckpt_every=4, log_every=2),
    # >= 100M parameters; one run of 3,000 steps in about 8 minutes on one H200 (see the
    # module docstring for the arithmetic).
    "h200": Config(d_model=1024, layers=8, heads=16, seq=1024, batch=48, steps=3000,
                   lr=6e-4, warmup=150, eval_every=100, eval_batches=8, probe_every=100,
                   timing_warmup=10, ckpt_every=500, log_every=10),
}


# ----------------------------------------------------------------------------- runs

@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One entry of the runs table: how the FP8 Dense layers compute their GEMMs.

    kind: "bf16" (plain Dense), "jax_fp8" (Fp8DotGeneral + Fp8TrainState with `recipe`)
      or "flax_fp8" (Flax's Fp8DirectDotGeneralOp).
    recipe: for kind "jax_fp8", a function of the Config returning the recipe; a run
      whose recipe the library does not provide or accept yet is skipped with a message.
    grad_scale: which scale the run's GEMM backward quantizes the incoming gradient
      with, for the underflow plot: "state" (a delayed-scaling state's), "current"
      (the FP8 type's max / amax of the tensor itself) or None (bf16: no FP8; blockwise:
      per block).
    grad_dtype: the FP8 type the run quantizes gradients to; the underflow probe casts
      to it (bf16 runs: what an FP8 run of the default recipe would use).
    """

    kind: str
    description: str
    recipe: Callable[[Config], Any] | None = None
    grad_scale: str | None = None
    grad_dtype: str = "float8_e5m2"


def _recipe(name: str, **kwargs):
    def make(cfg: Config):
        cls = getattr(jax_fp8, name, None)
        if cls is None:
            raise NotImplementedError(f"jax_fp8.{name} does not exist in this version")
        if name == "DelayedScaling":
            kwargs.setdefault("history_len", cfg.history_len)
        return cls(**kwargs)
    return make


RUNS = {
    "bf16": RunSpec("bf16", "nn.Dense, bf16 compute"),
    "jax_fp8_delayed": RunSpec("jax_fp8", "jax_fp8 Fp8DotGeneral, DelayedScaling HYBRID",
                               _recipe("DelayedScaling", fp8_format=jax_fp8.Format.HYBRID),
                               grad_scale="state"),
    "jax_fp8_delayed_e4m3": RunSpec("jax_fp8", "jax_fp8 Fp8DotGeneral, DelayedScaling E4M3",
                                    _recipe("DelayedScaling", fp8_format=jax_fp8.Format.E4M3),
                                    grad_scale="state", grad_dtype="float8_e4m3fn"),
    "flax_fp8": RunSpec("flax_fp8", "flax.linen.Fp8DirectDotGeneralOp", grad_scale="state"),
    "jax_fp8_current": RunSpec("jax_fp8", "jax_fp8 Fp8DotGeneral, Float8CurrentScaling",
                               _recipe("Float8CurrentScaling"), grad_scale="current"),
    "jax_fp8_blockwise": RunSpec("jax_fp8", "jax_fp8 Fp8DotGeneral, Float8BlockScaling "
                                 "(E4M3, 1x128 / 128x128 blocks)",
                                 _recipe("Float8BlockScaling")),
}


# What the library raises for a recipe it does not support (yet) in a layer or train state.
REFUSED = (NotImplementedError, TypeError, ValueError, AttributeError)


class Skip(Exception):
    """A run that cannot be made with this library version (reported, not fatal)."""


# ----------------------------------------------------------------------------- model

class Block(nn.Module):
    d_model: int
    heads: int
    layers: int
    dtype: Any
    dot_general_cls: Any = None
    attention: str | None = None
    probe: tuple = ()          # names of the Dense layers whose output gradient is probed

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        std = 0.02
        init = nn.initializers.normal(std)
        resid_init = nn.initializers.normal(std / math.sqrt(2 * self.layers))

        def fp8_dense(h, features, name, kernel_init=init):
            y = nn.Dense(features, dtype=self.dtype, param_dtype=jnp.float32,
                         kernel_init=kernel_init, dot_general_cls=self.dot_general_cls,
                         name=name)(h)
            # A no-op unless a "perturbations" collection is passed (the underflow probe
            # takes its gradient: the cotangent this GEMM's backward receives).
            return self.perturb(f"{name}_grad", y) if name in self.probe else y

        h = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_attn")(x)
        qkv = fp8_dense(h, 3 * d, "qkv").reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=self.attention)
        x = x + fp8_dense(o.reshape(b, t, d), d, "attn_out", resid_init)
        h = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_mlp")(x)
        h = nn.gelu(fp8_dense(h, 4 * d, "mlp_in"))
        return x + fp8_dense(h, d, "mlp_out", resid_init)


class GPT(nn.Module):
    d_model: int
    layers: int
    heads: int
    seq: int
    vocab: int = 256
    dtype: Any = jnp.bfloat16
    dot_general_cls: Any = None
    attention: str | None = None
    probe: tuple = ()          # ((layer index, Dense name), ...)

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.normal(0.02)
        x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype, param_dtype=jnp.float32,
                     embedding_init=init, name="embed")(tokens)
        pos = self.param("pos", nn.initializers.normal(0.01), (self.seq, self.d_model))
        x = x + pos[: tokens.shape[1]].astype(self.dtype)
        for i in range(self.layers):
            probe = tuple(name for j, name in self.probe if j == i)
            x = Block(self.d_model, self.heads, self.layers, self.dtype, self.dot_general_cls,
                      self.attention, probe, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln_f")(x)
        return nn.Dense(self.vocab, dtype=self.dtype, param_dtype=jnp.float32,
                        kernel_init=init, name="head")(x)


def count_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def flops_per_token(cfg: Config, n_params: int) -> dict:
    """Training FLOPs per token: 6 N (every parameter) + attention's two GEMMs (x3, fwd+bwd)."""
    six_n = 6 * n_params
    attn = 12 * cfg.layers * cfg.seq * cfg.d_model
    return {"six_n": six_n, "attention": attn, "total": six_n + attn}


# ----------------------------------------------------------------------------- data

def stdlib_files(root: pathlib.Path | None = None) -> tuple[pathlib.Path, list[pathlib.Path]]:
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if "site-packages" not in p.relative_to(root).parts and p.is_file()]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


class ByteData:
    """The stdlib's *.py files as bytes, split by file; deterministic windows."""

    def __init__(self, cfg: Config, root=None):
        self.root, files = stdlib_files(root)
        if len(files) < 2:
            raise RuntimeError(f"found {len(files)} *.py files under {self.root}")
        rng = np.random.default_rng(cfg.data_seed)
        n_val = min(len(files) - 1, max(1, round(cfg.val_fraction * len(files))))
        val_idx = set(rng.permutation(len(files))[:n_val].tolist())
        parts = {"train": [], "val": []}
        for i, f in enumerate(files):
            parts["val" if i in val_idx else "train"].append(f.read_bytes() + b"\0")
        self.files = {k: len(v) for k, v in parts.items()}
        self.train = np.frombuffer(b"".join(parts["train"]), np.uint8)
        self.val = np.frombuffer(b"".join(parts["val"]), np.uint8)
        self.seed, self.batch, self.seq = cfg.seed, cfg.batch, cfg.seq
        for name, arr in (("train", self.train), ("val", self.val)):
            if len(arr) <= self.seq + 1:
                raise RuntimeError(f"{name} split has {len(arr)} bytes, less than a window")
        self._offsets = np.arange(self.seq + 1)

    def _windows(self, data, rng, n):
        starts = rng.integers(0, len(data) - self.seq - 1, size=n)
        return data[starts[:, None] + self._offsets].astype(np.int32)

    def train_batch(self, step: int) -> np.ndarray:
        """Batch `step` of the training sequence: [batch, seq + 1] int32, same for every run."""
        return self._windows(self.train, np.random.default_rng([self.seed, 0, step]),
                             self.batch)

    def val_batches(self, n: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, 1])
        return [self._windows(self.val, rng, self.batch) for _ in range(n)]

    def describe(self) -> dict:
        return {"source": "Python standard library *.py (site-packages excluded)",
                "root": str(self.root), "python": platform.python_version(),
                "files_train": self.files["train"], "files_val": self.files["val"],
                "bytes_train": int(self.train.size), "bytes_val": int(self.val.size)}


# ----------------------------------------------------------------------------- training

def cross_entropy(logits, batch):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


def make_optimizer(cfg: Config):
    sched = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, max(1, min(cfg.warmup, cfg.steps - 1)), max(cfg.steps, 2),
        end_value=cfg.lr * cfg.min_lr_ratio)
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                   mask=decay))


def tracked_tensors(cfg: Config):
    """FP8 tensors whose amax and scale are recorded every step: (label, layer, Dense, role)."""
    last = cfg.layers - 1
    return [(f"block_{i}/{name}/{role}", i, name, role)
            for i, name in ((0, "qkv"), (last, "mlp_out"))
            for role in ("input", "kernel", "grad")]


def probed_layers(cfg: Config):
    """Layers whose incoming gradient is checked for E5M2 underflow: (label, layer, Dense)."""
    last = cfg.layers - 1
    picks = [(0, "qkv"), (0, "mlp_out"), (last, "attn_out"), (last, "mlp_in")]
    return [(f"block_{i}/{name}", i, name) for i, name in dict.fromkeys(picks)]


_FLAX_ROLE = {"input": "input", "kernel": "kernel", "grad": "output_grad"}


def _only_child(tree, where):
    if len(tree) != 1:
        raise KeyError(f"expected one FP8 op under {where}, found {sorted(tree)}")
    return next(iter(tree.values()))


def fp8_scale_of(kind, state, layer, name, role):
    """(newest amax, multiplying scale) of one FP8 tensor of a train state, or None."""
    block = f"block_{layer}"
    if kind == "jax_fp8":
        tree = jax_fp8.unpack_states(state.fp8) if state.fp8 is not None else {}
        try:
            st = _only_child(tree[block][name], f"{block}/{name}")[role]
        except (KeyError, TypeError):
            return None
        if not isinstance(st, jax_fp8.ScalingState):
            return None
        return st.amax_history[..., -1].reshape(()), st.scale.reshape(())
    if kind == "flax_fp8":
        op = _only_child(state.params[FLAX_OWG][block][name], f"{block}/{name}")
        r = _FLAX_ROLE[role]
        # Flax divides by its scale, and writes the newest amax at index 0.
        return op[f"{r}_amax_history"][0], 1.0 / op[f"{r}_scale"].reshape(())
    return None


class Run:
    """One run: its model, train state, compiled step, evaluation and probes."""

    def __init__(self, name: str, cfg: Config, params0, attention):
        self.name, self.cfg = name, cfg
        self.spec = RUNS[name]
        kind = self.kind = self.spec.kind
        self.recipe = None
        if kind == "jax_fp8":
            try:
                self.recipe = self.spec.recipe(cfg)
            except REFUSED as e:
                raise Skip(f"{type(e).__name__}: {e}") from e
            dg = functools.partial(Fp8DotGeneral, recipe=self.recipe)
        elif kind == "flax_fp8":
            if FLAX_OP is None:
                raise Skip(f"flax {flax.__version__} has no Fp8DirectDotGeneralOp")
            dg = functools.partial(FLAX_OP, amax_history_length=cfg.history_len)
        else:
            dg = None
        probe = tuple((i, n) for _, i, n in probed_layers(cfg))
        self.model = GPT(cfg.d_model, cfg.layers, cfg.heads, cfg.seq, dot_general_cls=dg,
                         attention=attention, probe=probe)
        self.tx = make_optimizer(cfg)
        self.sample = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
        try:
            self.extra = self._init_extra()
            self.fresh_state(params0)       # checks the recipe is accepted
        except REFUSED as e:
            if kind != "jax_fp8":
                raise
            raise Skip(f"{type(e).__name__}: {e}") from e
        self.perturbations = jax.eval_shape(self.model.init, jax.random.key(0),
                                            self.sample)["perturbations"]

    def _init_extra(self):
        """The non-parameter collection of an FP8 run (fresh FP8 state), or None."""
        coll = {"jax_fp8": FP8_COLLECTION, "flax_fp8": FLAX_OWG}.get(self.kind)
        if coll is None:
            return None
        model, sample = self.model, self.sample
        extra = jax.jit(lambda k: model.init(k, sample).get(coll))(jax.random.key(0))
        return jax.device_get(extra)

    def fresh_state(self, params0):
        """A train state at step 0 from the shared initial weights (fresh device buffers)."""
        params = jax.device_put(params0)
        extra = None if self.extra is None else jax.device_put(self.extra)
        if self.kind == "jax_fp8":
            variables = {"params": params}
            if extra:
                variables[FP8_COLLECTION] = extra
            return Fp8TrainState.create(apply_fn=self.model.apply, variables=variables,
                                        tx=self.tx, recipe=self.recipe)
        if self.kind == "flax_fp8":
            return train_state.TrainState.create(apply_fn=self.model.apply, tx=self.tx,
                                                 params={"params": params, FLAX_OWG: extra})
        return train_state.TrainState.create(apply_fn=self.model.apply, params=params,
                                             tx=self.tx)

    # -- the jitted functions

    def _loss_and_grads(self, state, batch):
        """(loss, param grads, FP8-state grads or None, grads of the probed Dense outputs).

        The probed layers add a zero "perturbation" to their output; its gradient is the
        cotangent that layer's GEMM backward receives (quantized to E5M2 by the FP8 runs).
        """
        x = batch[:, :-1]
        kind = self.kind
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.perturbations)
        if kind == "jax_fp8":
            def loss_fn(params, fp8, pt):
                # = state.apply_model(params, fp8, x), with the perturbations added
                out, _ = state.apply_fn({**state.variables(params, fp8), "perturbations": pt},
                                        x, mutable=[state.fp8_collection])
                return cross_entropy(out, batch)
            loss, (grads, fp8_grads, pgrads) = jax.value_and_grad(
                loss_fn, argnums=(0, 1, 2))(state.params, state.fp8, zeros)
            return loss, grads, fp8_grads, pgrads

        def loss_fn(params, pt):
            v = dict(params) if kind == "flax_fp8" else {"params": params}
            return cross_entropy(state.apply_fn({**v, "perturbations": pt}, x), batch)
        loss, (grads, pgrads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params,
                                                                            zeros)
        return loss, grads, None, pgrads

    def track(self, state):
        """[n tracked, 2]: (newest amax, scale) per tracked FP8 tensor, or None."""
        rows = [fp8_scale_of(self.kind, state, i, n, r)
                for _, i, n, r in tracked_tensors(self.cfg)]
        if not rows or any(r is None for r in rows):
            return None
        return jnp.stack([jnp.stack([a.astype(jnp.float32), s.astype(jnp.float32)])
                          for a, s in rows])

    def underflow(self, state, pgrads):
        """[n probed, 2]: underflow fraction, in the run's gradient FP8 type, of each probed
        layer's incoming gradient, with the scale the run quantizes it with this step (NaN
        where it has none) and with the current per-tensor scale (max of the type / amax)."""
        rows = []
        dtype = jnp.dtype(self.spec.grad_dtype)
        for _, i, name in probed_layers(self.cfg):
            grad = pgrads[f"block_{i}"][f"{name}_grad"].astype(jnp.float32)
            amax = jnp.max(jnp.abs(grad))
            current = jnp.where(amax > 0, float(jnp.finfo(dtype).max) / amax, 1.0)
            own = fp8_scale_of(self.kind, state, i, name, "grad")
            rows.append(jnp.stack([underflow_fraction(grad, own[1], dtype) if own else jnp.nan,
                                   underflow_fraction(grad, current, dtype)]))
        return jnp.stack(rows).astype(jnp.float32)

    def train_step(self, state, batch):
        loss, grads, fp8_grads, pgrads = self._loss_and_grads(state, batch)
        # Every probe_every steps (state.step is the step being taken): the underflow
        # fractions, from the state's scales before this step's FP8-state update.
        n = len(probed_layers(self.cfg))
        underflow = jax.lax.cond(
            state.step % self.cfg.probe_every == 0,
            lambda: self.underflow(state, pgrads),
            lambda: jnp.full((n, 2), jnp.nan, jnp.float32))
        if self.kind == "jax_fp8":
            new = state.apply_gradients(grads=grads, fp8_grads=fp8_grads)
            gnorm = optax.global_norm(grads)
        else:
            new = state.apply_gradients(grads=grads)
            gnorm = optax.global_norm(grads["params"] if self.kind == "flax_fp8" else grads)
        metrics = {"loss": loss, "grad_norm": gnorm, "underflow": underflow}
        track = self.track(new)
        if track is not None:
            metrics["track"] = track
        return new, metrics

    def eval_loss(self, state, batch):
        x = batch[:, :-1]
        if self.kind == "jax_fp8":
            return cross_entropy(state.apply_model(state.params, state.fp8, x), batch)
        v = state.params if self.kind == "flax_fp8" else {"params": state.params}
        return cross_entropy(state.apply_fn(v, x), batch)


def underflow_fraction(grad, scale, dtype=jnp.float8_e5m2):
    """Fraction of the nonzero values of `grad` that are 0 after `grad * scale` -> dtype."""
    q = (grad * scale.astype(jnp.float32)).astype(dtype)
    nonzero = grad != 0
    lost = jnp.sum(nonzero & (q.astype(jnp.float32) == 0))
    return lost / jnp.maximum(jnp.sum(nonzero), 1)


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

    def write(self, msg: str):
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_manager(path: pathlib.Path):
    import orbax.checkpoint as ocp
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
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


def new_record(run: Run) -> dict:
    has_state = run.kind == "flax_fp8" or (run.kind == "jax_fp8" and bool(run.extra))
    return {"description": run.spec.description, "kind": run.kind,
            "recipe": None if run.recipe is None else repr(run.recipe),
            "grad_scale": run.spec.grad_scale, "grad_dtype": run.spec.grad_dtype,
            "train_loss": [], "grad_norm": [], "val_steps": [], "val_loss": [],
            "fp8_tracked": {label: {"amax": [], "scale": []}
                            for label, *_ in tracked_tensors(run.cfg)} if has_state else {},
            "e5m2_underflow": {"steps": [], "layers": {
                label: {"run_scale": [], "current_scale": []}
                for label, *_ in probed_layers(run.cfg)}},
            "timed_steps": 0, "timed_s": 0.0, "processes": [], "complete": False}


def train_run(run: Run, cfg: Config, data: ByteData, params0, out: pathlib.Path, args,
              deadline: Deadline) -> tuple[dict, bool]:
    """Trains (or resumes) one run; returns (its record, finished)."""
    ckpt_dir = out / run.name / "ckpt"
    mngr, latest = None, None
    if ckpt_dir.exists():
        mngr = checkpoint_manager(ckpt_dir)
        latest = mngr.latest_step()
        if latest is not None and not args.resume:
            mngr.close()
            raise SystemExit(f"{ckpt_dir} has checkpoints (latest step {latest}): pass "
                             f"--resume to continue the run, or use another --out")
        if latest is not None and latest >= cfg.steps:
            record = restore_record(mngr, latest)
            mngr.close()
            log(f"[{run.name}] already complete ({latest} steps)")
            return record, True

    state = run.fresh_state(params0)
    record = new_record(run)
    proc = {"start_step": 0, "device": jax.devices()[0].device_kind}
    batch0 = jnp.asarray(data.train_batch(0))
    t = time.perf_counter()
    try:
        step_fn = jax.jit(run.train_step, donate_argnums=(0,)).lower(state, batch0).compile()
    except REFUSED as e:
        if run.kind != "jax_fp8":
            raise
        if mngr is not None:
            mngr.close()
        raise Skip(f"{type(e).__name__}: {e}") from e
    proc["compile_s"] = round(time.perf_counter() - t, 3)
    log(f"[{run.name}] compiled the step in {proc['compile_s']:.1f} s")
    eval_fn = jax.jit(run.eval_loss)
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
        log(f"[{run.name}] resumed from {ckpt_dir} at step {start}")
    if mngr is None:
        mngr = checkpoint_manager(ckpt_dir)
    eval_s = 0.0

    def evaluate(step):
        nonlocal eval_s
        t = time.perf_counter()
        losses = [eval_fn(state, b) for b in val]
        v = float(np.mean(jax.device_get(losses)))
        eval_s = time.perf_counter() - t
        if record["val_steps"] and record["val_steps"][-1] == step:
            record["val_loss"][-1] = v
        else:
            record["val_steps"].append(step)
            record["val_loss"].append(v)
        return v

    pending = []

    def flush():
        got = jax.device_get(pending)
        for m in got:
            step_taken = len(record["train_loss"])
            if step_taken % cfg.probe_every == 0:
                und = record["e5m2_underflow"]
                und["steps"].append(step_taken)
                for (label, *_), (own, cur) in zip(probed_layers(cfg), m["underflow"]):
                    series = und["layers"][label]
                    series["run_scale"].append(None if np.isnan(own) else float(own))
                    series["current_scale"].append(float(cur))
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
    bar = Progress(run.name, cfg.steps, start)
    stopped = None
    if start == 0:
        evaluate(0)
    t_loop = time.perf_counter()
    step = start
    try:
        while step < cfg.steps:
            batch = jnp.asarray(data.train_batch(step))
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
            # Time to reach the next sync point, evaluate, checkpoint, plot and exit (before
            # the first timed segment the step time is unknown: the steps so far include
            # compilation, so they would overstate it many times).
            reserve = (2 * (ckpt_s or 10.0) + 2 * cfg.log_every * (step_s or 0.0)
                       + 2 * eval_s + 15.0)
            if not stop and step < cfg.steps and not deadline.allows(reserve):
                stop = True
            if step % cfg.ckpt_every == 0 or step == cfg.steps or stop:
                t = time.perf_counter()
                proc["loop_s"] = round(t - t_loop, 3)
                _finish_record(record, proc, step, timed_s, timed_steps, tokens_per_step,
                               start, cfg)
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
    wall = time.perf_counter() - t_loop
    proc["loop_s"] = round(wall, 3)
    _finish_record(record, proc, step, timed_s, timed_steps, tokens_per_step, start, cfg)
    if stopped is not None and stopped < cfg.steps:
        log(f"[{run.name}] stopped at step {stopped}/{cfg.steps} (checkpointed); continue "
            f"with --resume")
        return record, False
    return record, True


def _finish_record(record, proc, step, timed_s, timed_steps, tokens_per_step, start, cfg):
    """Folds this process's counters into the record (idempotent within a process)."""
    proc.update(end_step=step, timed_steps=timed_steps, timed_s=round(timed_s, 4))
    procs = [p for p in record["processes"] if p is not proc and
             p.get("start_step") != proc["start_step"]]
    record["processes"] = procs + [dict(proc)]
    record["timed_steps"] = sum(p["timed_steps"] for p in record["processes"])
    record["timed_s"] = sum(p["timed_s"] for p in record["processes"])
    record["tokens_per_s"] = (tokens_per_step * record["timed_steps"] / record["timed_s"]
                              if record["timed_s"] > 0 else None)
    record["steps_done"] = step
    record["complete"] = step >= cfg.steps
    vl = record["val_loss"]
    record["final_val_loss"] = vl[-1] if record["complete"] and vl else None
    tl = record["train_loss"]
    k = max(1, min(len(tl), cfg.steps // 20))
    record["final_train_loss"] = float(np.mean(tl[-k:])) if record["complete"] and tl else None
    record["final_train_loss_window"] = k


# ----------------------------------------------------------------------------- results

def load_results(path: pathlib.Path):
    if path.exists():
        return json.loads(path.read_text())
    return None


def merge_results(path: pathlib.Path, header: dict, name: str | None = None,
                  record: dict | None = None, skipped: dict | None = None) -> dict:
    """Adds one run (or a skip note) to results.json, keeping the other runs' entries."""
    results = load_results(path)
    if results is None:
        results = {**header, "runs": {}, "skipped": {}}
    elif results.get("config") != header["config"]:
        raise SystemExit(f"{path} holds runs of another configuration "
                         f"({results.get('config')}); use another --out")
    else:
        # The device and versions of the newest process; each run keeps its own in
        # its "processes" list.
        results.update({k: v for k, v in header.items() if k not in ("runs", "skipped")})
    if record is not None:
        results["runs"][name] = record
        results.setdefault("skipped", {}).pop(name, None)
    if skipped:
        results.setdefault("skipped", {}).update(skipped)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)
    return results


# ----------------------------------------------------------------------------- plots

def _smooth(y, k):
    y = np.asarray(y, np.float64)
    if k <= 1 or len(y) < 2 * k:
        return np.arange(len(y)), y
    return np.arange(k - 1, len(y)), np.convolve(y, np.ones(k) / k, mode="valid")


def plot_results(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """loss.png (train, validation, difference to bf16) and fp8.png (amax, scale, underflow)."""
    mpl_dir = None
    if "MPLCONFIGDIR" not in os.environ:   # keep matplotlib's font cache inside --out
        mpl_dir = tempfile.mkdtemp(prefix=".matplotlib-", dir=out)
        os.environ["MPLCONFIGDIR"] = mpl_dir
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    try:
        return _plot(results, out, plt)
    finally:
        if mpl_dir is not None:
            os.environ.pop("MPLCONFIGDIR", None)
            shutil.rmtree(mpl_dir, ignore_errors=True)


def _plot(results, out, plt):
    runs = results.get("runs", {})
    steps = results.get("steps", 1)
    k = max(1, steps // 60)
    written = []
    cfg = results.get("config", {})
    title = (f"byte GPT {results.get('params', 0) / 1e6:.1f}M params, "
             f"d={cfg.get('d_model')} L={cfg.get('layers')} T={cfg.get('seq')} "
             f"B={cfg.get('batch')}, {results.get('device', '')}")
    ref = runs.get("bf16")
    ncols = 3 if ref and len(runs) > 1 else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.2))
    late = []  # train-loss values after the first 10 % of steps (for the y range)
    for ri, (name, r) in enumerate(runs.items()):
        color = f"C{ri}"
        x, y = _smooth(r["train_loss"], k)
        axes[0].plot(x, y, color=color, label=name, lw=1.2)
        late.extend(y[x >= steps // 10].tolist())
        axes[1].plot(r["val_steps"], r["val_loss"], color=color, marker=".", label=name,
                     lw=1.2)
        if ncols == 3 and name != "bf16":
            n = min(len(r["train_loss"]), len(ref["train_loss"]))
            diff = np.asarray(r["train_loss"][:n]) - np.asarray(ref["train_loss"][:n])
            axes[2].plot(*_smooth(diff, k), color=color, label=f"{name} - bf16", lw=1.2)
    axes[0].set_title(f"train loss (nats/byte, {k}-step mean)")
    axes[1].set_title("validation loss (nats/byte)")
    vals = [v for r in runs.values() for v in r["val_loss"][1:]]
    for a, v in ((axes[0], late), (axes[1], vals)):
        if v:
            lo, hi = min(v), max(v)
            a.set_ylim(lo - 0.05 * (hi - lo) - 0.02, hi + 0.1 * (hi - lo) + 0.02)
    if ncols == 3:
        axes[2].axhline(0, color="k", lw=0.6)
        axes[2].set_title("train loss minus bf16's")
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=9)
    # (fixed margins: tight_layout costs seconds with these legends)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.12, top=0.86, wspace=0.25)
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    written.append(out / "loss.png")

    from matplotlib.lines import Line2D
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
    fig, axes = plt.subplots(1, 3, figsize=(16.5, 4.6))
    tensors, layers = {}, {}             # legend entries: colours per tensor / layer,
    shown_track, shown_und = {}, {}      # line styles per run
    for ri, (name, r) in enumerate(runs.items()):
        ls = styles[ri % len(styles)]   # line style per run, colour per tensor / layer
        for label, series in r.get("fp8_tracked", {}).items():
            if not series["amax"]:
                continue
            c = tensors.setdefault(label, f"C{len(tensors)}")
            axes[0].semilogy(series["amax"], ls=ls, color=c, lw=1)
            axes[1].semilogy(series["scale"], ls=ls, color=c, lw=1)
            shown_track[name] = ls
        und = r.get("e5m2_underflow", {})
        which = r.get("grad_scale")
        for label, s in und.get("layers", {}).items():
            c = layers.setdefault(label, f"C{len(layers)}")
            own = [np.nan if v is None else v for v in s["run_scale"]]
            if which == "state" and not np.all(np.isnan(own)):
                axes[2].plot(und["steps"], own, ls=ls, color=c, marker=".", lw=1)
            elif which == "current" or name == "bf16":   # bf16: what current scaling would do
                axes[2].plot(und["steps"], s["current_scale"], ls=ls, color=c, marker="x",
                             lw=0.8)
            else:
                continue
            shown_und[name] = ls
    axes[0].set_title("newest amax per step")
    axes[1].set_title("scale (x * scale -> FP8)")
    axes[2].set_title("gradient underflow: nonzero bf16 grads -> 0 in E5M2 (E4M3 runs: "
                      "E4M3)\n(FP8 runs: their scale; bf16: the current scale)", fontsize=9)
    axes[2].set_yscale("symlog", linthresh=1e-6)
    for a in axes:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    def run_handles(shown):
        return [Line2D([], [], color="k", ls=ls, lw=1, label=n) for n, ls in shown.items()]
    if tensors:
        axes[0].legend(handles=run_handles(shown_track), fontsize=7, loc="upper right")
        axes[1].legend(handles=[Line2D([], [], color=c, lw=2, label=t)
                                for t, c in tensors.items()], fontsize=7, loc="upper right")
    if layers:
        axes[2].legend(handles=[Line2D([], [], color=c, lw=2, label=t)
                                for t, c in layers.items()] + run_handles(shown_und),
                       fontsize=6, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.12, top=0.86, wspace=0.22)
    fig.savefig(out / "fp8.png", dpi=120)
    plt.close(fig)
    written.append(out / "fp8.png")
    return written


def summary_table(results: dict) -> str:
    """Final train/validation loss of each run, its gap to bf16, tokens/s."""
    runs = results.get("runs", {})
    ref = runs.get("bf16", {}).get("final_val_loss")

    def num(v, spec=".4f"):
        return "-" if v is None else format(v, spec)

    lines = [f"{'run':20s} {'steps':>11s} {'train':>8s} {'val':>8s} {'val vs bf16':>11s} "
             f"{'tokens/s':>12s}"]
    for name, r in runs.items():
        fv = r.get("final_val_loss")
        gap = f"{100 * (fv - ref) / ref:+.2f}%" if fv is not None and ref else "-"
        done = f"{r.get('steps_done', 0)}/{results.get('steps')}"
        lines.append(f"{name:20s} {done:>11s} {num(r.get('final_train_loss')):>8s} "
                     f"{num(fv):>8s} {gap:>11s} {num(r.get('tokens_per_s'), ',.0f'):>12s}")
    for name, why in results.get("skipped", {}).items():
        lines.append(f"{name:20s} skipped: {why}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    ap.add_argument("--runs", default="all",
                    help=f"comma-separated, or 'all' (the default): {', '.join(RUNS)}")
    ap.add_argument("--out", default="runs/convergence")
    ap.add_argument("--resume", action="store_true",
                    help="continue each run from its latest checkpoint under --out/<run>/ckpt")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="checkpoint and exit before this many minutes since the start")
    ap.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                    help="checkpoint and exit after this many steps of this process "
                         "(as --max-minutes does; for testing --resume)")
    ap.add_argument("--exit-code-unfinished", type=int, default=0,
                    help="exit status when a run stopped before its last step (default 0)")
    ap.add_argument("--plot-only", action="store_true",
                    help="only (re)draw the plots from --out/results.json")
    ap.add_argument("--no-plot", action="store_true",
                    help="write results.json but no plots (e.g. for a process that a later "
                         "one continues)")
    ap.add_argument("--attention", choices=["auto", "xla", "cudnn"], default="auto",
                    help="jax.nn.dot_product_attention implementation (auto: cudnn on a "
                         "GPU when it compiles, else xla); the same for every run")
    for field in dataclasses.fields(Config):
        flag = "--" + {"seq": "seq"}.get(field.name, field.name).replace("_", "-")
        ap.add_argument(flag, type=type(PRESETS["smoke"].__dict__[field.name]), default=None,
                        dest=field.name, help=f"override the preset's {field.name}")
    args = ap.parse_args(argv)
    cfg = dataclasses.replace(PRESETS[args.preset], **{
        f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
        if getattr(args, f.name) is not None})
    if cfg.d_model % cfg.heads:
        ap.error("--d-model must be divisible by --heads")
    for name in ("eval_every", "probe_every", "ckpt_every", "log_every", "steps", "batch"):
        if getattr(cfg, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    names = list(RUNS) if args.runs == "all" else [r for r in args.runs.split(",") if r]
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


def main(argv=None, started: float | None = None) -> dict:
    """Trains the requested runs; returns the merged results.json contents.

    started: time.monotonic() at which --max-minutes counts from (default: now).
    """
    started = time.monotonic() if started is None else started
    args, cfg = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    if args.plot_only:
        results = load_results(results_path)
        if results is None:
            raise SystemExit(f"no {results_path}")
        for p in plot_results(results, out):
            log(f"wrote {p}")
        print(summary_table(results))
        return results

    if not args.resume:
        for name in args.run_names:
            ckpt = out / name / "ckpt"
            if ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir()):
                raise SystemExit(f"{ckpt} has checkpoints: pass --resume to continue the "
                                 f"run, or use another --out")
    deadline = Deadline(started, args.max_minutes)
    data = ByteData(cfg)
    attention = pick_attention(args.attention, cfg)
    ref_model = GPT(cfg.d_model, cfg.layers, cfg.heads, cfg.seq, attention=attention)
    sample = jnp.zeros((cfg.batch, cfg.seq), jnp.int32)
    # The initial weights of every run: float32, one fixed key, created once.
    params0 = jax.device_get(jax.jit(lambda k: ref_model.init(k, sample)["params"])(
        jax.random.key(cfg.seed)))
    n_params = count_params(params0)
    flops = flops_per_token(cfg, n_params)
    header = {
        "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
        "jax_version": jax.__version__, "flax_version": flax.__version__,
        "preset": args.preset, "steps": cfg.steps, "params": n_params,
        "tokens_per_step": cfg.batch * cfg.seq, "flops_per_token": flops,
        "attention": attention, "config": cfg.comparable(), "data": data.describe(),
        "tracked_tensors": [t[0] for t in tracked_tensors(cfg)],
        "probed_layers": [p[0] for p in probed_layers(cfg)],
    }
    log(f"{header['device']} ({header['backend']}), {n_params / 1e6:.2f}M params, "
        f"{header['tokens_per_step']:,} tokens/step, {flops['total'] / 1e6:.0f} MFLOP/token, "
        f"data {data.files['train']}+{data.files['val']} files "
        f"({data.train.size / 1e6:.1f}+{data.val.size / 1e6:.1f} MB), attention {attention}")

    unfinished = False
    results = None
    for name in args.run_names:
        if not deadline.allows(30.0):
            log(f"[{name}] not started: --max-minutes leaves no time")
            unfinished = True
            continue
        try:
            run = Run(name, cfg, params0, attention)
            record, finished = train_run(run, cfg, data, params0, out, args, deadline)
        except Skip as e:
            msg = (f"the library does not accept this recipe yet "
                   f"({str(e).splitlines()[0][:300]})")
            log(f"[{name}] skipped: {msg}")
            results = merge_results(results_path, header, skipped={name: msg})
            continue
        unfinished |= not finished
        results = merge_results(results_path, header, name, record)
        del run
    if results is None:
        results = load_results(results_path) or {**header, "runs": {}}
    if not args.no_plot:
        for p in plot_results(results, out):
            log(f"wrote {p}")
    log(f"wrote {results_path}")
    print(summary_table(results))
    if unfinished and args.exit_code_unfinished:
        sys.exit(args.exit_code_unfinished)
    return results


if __name__ == "__main__":
    main(started=_STARTED)
