"""Convergence of FP8 training against bf16: a byte-level GPT trained per recipe and seed.

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
import math
import os
import pathlib
import platform
import shutil
import subprocess
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
import scipy.stats
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
REFERENCE = "bf16"
DOC_BEGIN = "<!-- BEGIN convergence results -->"
DOC_END = "<!-- END convergence results -->"


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
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
    min_lr_ratio: float = 0.01
    decay_fraction: float = 0.9
    weight_decay: float = 0.1
    clip: float = 1.0
    # data
    val_fraction: float = 0.05
    data_seed: int = 1234
    # measurement
    eval_every: int = 100
    eval_batches: int = 16
    probe_every: int = 250
    tail_fraction: float = 0.2
    record_every: int = 20
    # bookkeeping (not part of what makes runs comparable)
    timing_warmup: int = 10
    ckpt_every: int = 1000
    log_every: int = 50

    # Fields that the runs summarized together must share.
    COMPARABLE = ("d_model", "layers", "heads", "seq", "batch", "steps", "lr", "warmup",
                  "min_lr_ratio", "decay_fraction", "weight_decay", "clip", "val_fraction",
                  "data_seed", "eval_every", "eval_batches", "probe_every", "tail_fraction",
                  "record_every")

    def comparable(self) -> dict:
        return {k: getattr(self, k) for k in self.COMPARABLE}

    @property
    def decay_end(self) -> int:
        """The step at which the cosine decay reaches the floor."""
        return max(self.warmup + 1, round(self.decay_fraction * self.steps))

    @property
    def tail_start(self) -> int:
        """Evaluations and steps after this step form the averaged last part of a run."""
        return math.floor((1.0 - self.tail_fraction) * self.steps)


PRESETS = {
    # A tiny model: the same code path as h200, on CPU in seconds.
    "smoke": Config(d_model=64, layers=2, heads=2, seq=64, batch=4, steps=8, lr=3e-3,
                    warmup=2, eval_every=4, eval_batches=2, probe_every=4, record_every=2,
                    timing_warmup=1, ckpt_every=4, log_every=2),
    # 102M parameters, 4,096 tokens per step, 5,000 steps (see docs/convergence.md for
    # the protocol and the time a run takes on one H200).
    "h200": Config(d_model=1024, layers=8, heads=16, seq=1024, batch=4, steps=5000,
                   lr=6e-4, warmup=250),
}


# ----------------------------------------------------------------------------- runs

@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One entry of the runs table: how the FP8 Dense layers compute their GEMMs.

    kind: "bf16" (plain Dense), "jax_fp8" (Fp8DotGeneral + Fp8TrainState with `recipe`)
      or "flax_fp8" (Flax's Fp8DirectDotGeneralOp with `history_len`).
    recipe: for kind "jax_fp8", a function of no arguments returning the recipe; a run
      whose recipe the library does not provide or accept is skipped with a message.
    grad_scale: which scale the run's GEMM backward quantizes the incoming gradient
      with, for the underflow plot: "state" (a delayed-scaling state's), "current"
      (the FP8 type's max / amax of the tensor itself) or None (bf16: no FP8; blockwise:
      per block).
    grad_dtype: the FP8 type the run quantizes gradients to; the underflow probe casts
      to it (bf16 runs: what an FP8 run of the default recipe would use).
    """

    kind: str
    description: str
    recipe: Callable[[], Any] | None = None
    grad_scale: str | None = None
    grad_dtype: str = "float8_e5m2"
    history_len: int = 1024


def _recipe(name: str, **kwargs):
    def make():
        cls = getattr(jax_fp8, name, None)
        if cls is None:
            raise NotImplementedError(f"jax_fp8.{name} does not exist in this version")
        return cls(**kwargs)
    return make


_HYBRID, _E4M3 = jax_fp8.Format.HYBRID, jax_fp8.Format.E4M3

RUNS = {
    "bf16": RunSpec("bf16", "nn.Dense, bf16 compute"),
    "jax_fp8_delayed": RunSpec(
        "jax_fp8", "Fp8DotGeneral, DelayedScaling HYBRID, history 1024",
        _recipe("DelayedScaling", fp8_format=_HYBRID, history_len=1024), grad_scale="state"),
    "jax_fp8_delayed_h16": RunSpec(
        "jax_fp8", "Fp8DotGeneral, DelayedScaling HYBRID, history 16",
        _recipe("DelayedScaling", fp8_format=_HYBRID, history_len=16), grad_scale="state"),
    "jax_fp8_blockwise": RunSpec(
        "jax_fp8", "Fp8DotGeneral, Float8BlockScaling (E4M3, 1x128 / 128x128 blocks)",
        _recipe("Float8BlockScaling")),
    "jax_fp8_current": RunSpec(
        "jax_fp8", "Fp8DotGeneral, Float8CurrentScaling (HYBRID)",
        _recipe("Float8CurrentScaling"), grad_scale="current"),
    "jax_fp8_delayed_e4m3": RunSpec(
        "jax_fp8", "Fp8DotGeneral, DelayedScaling E4M3, history 1024",
        _recipe("DelayedScaling", fp8_format=_E4M3, history_len=1024), grad_scale="state",
        grad_dtype="float8_e4m3fn"),
    "flax_fp8": RunSpec("flax_fp8", "flax.linen.Fp8DirectDotGeneralOp, history 1024",
                        grad_scale="state"),
}
# The runs of the protocol in docs/convergence.md (the default --runs).
PROTOCOL_RUNS = ("bf16", "jax_fp8_delayed", "jax_fp8_delayed_h16", "jax_fp8_blockwise",
                 "jax_fp8_current")

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
        self.data_seed, self.batch, self.seq = cfg.data_seed, cfg.batch, cfg.seq
        for name, arr in (("train", self.train), ("val", self.val)):
            if len(arr) <= self.seq + 1:
                raise RuntimeError(f"{name} split has {len(arr)} bytes, less than a window")
        self._offsets = np.arange(self.seq + 1)

    def _windows(self, data, rng, n):
        starts = rng.integers(0, len(data) - self.seq - 1, size=n)
        return data[starts[:, None] + self._offsets].astype(np.int32)

    def train_batch(self, seed: int, step: int) -> np.ndarray:
        """Batch `step` of seed `seed`: [batch, seq + 1] int32, the same for every run."""
        return self._windows(self.train, np.random.default_rng([seed, 0, step]), self.batch)

    def val_batches(self, n: int) -> list[np.ndarray]:
        """The validation set: n batches, a function of the data seed only."""
        rng = np.random.default_rng([self.data_seed, 1])
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


def learning_rate(cfg: Config) -> optax.Schedule:
    """Linear warmup from 0 to cfg.lr over cfg.warmup steps, cosine decay to
    cfg.lr * cfg.min_lr_ratio at step cfg.decay_end, then constant at that floor."""
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, cfg.decay_end, end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: Config):
    decay = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(cfg.clip),
                       optax.adamw(learning_rate(cfg), b1=0.9, b2=0.95,
                                   weight_decay=cfg.weight_decay, mask=decay))


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
    """One run: its model, train state, compiled step (shared by every seed), evaluation
    and probes."""

    def __init__(self, name: str, cfg: Config, params0, attention):
        self.name, self.cfg = name, cfg
        self.spec = RUNS[name]
        kind = self.kind = self.spec.kind
        self.recipe = None
        if kind == "jax_fp8":
            try:
                self.recipe = self.spec.recipe()
            except REFUSED as e:
                raise Skip(f"{type(e).__name__}: {e}") from e
            dg = functools.partial(Fp8DotGeneral, recipe=self.recipe)
        elif kind == "flax_fp8":
            if FLAX_OP is None:
                raise Skip(f"flax {flax.__version__} has no Fp8DirectDotGeneralOp")
            dg = functools.partial(FLAX_OP, amax_history_length=self.spec.history_len)
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
        self._step_fn = None
        self.eval_fn = jax.jit(self.eval_loss)

    def _init_extra(self):
        """The non-parameter collection of an FP8 run (fresh FP8 state), or None."""
        coll = {"jax_fp8": FP8_COLLECTION, "flax_fp8": FLAX_OWG}.get(self.kind)
        if coll is None:
            return None
        model, sample = self.model, self.sample
        extra = jax.jit(lambda k: model.init(k, sample).get(coll))(jax.random.key(0))
        return jax.device_get(extra)

    @property
    def has_fp8_state(self) -> bool:
        return self.kind == "flax_fp8" or (self.kind == "jax_fp8" and bool(self.extra))

    def fresh_state(self, params0):
        """A train state at step 0 from the given initial weights (fresh device buffers)."""
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

    def step_fn(self, state, batch) -> tuple[Callable, float]:
        """(the compiled train step, seconds spent compiling it now: 0 when reused)."""
        if self._step_fn is not None:
            return self._step_fn, 0.0
        t = time.perf_counter()
        try:
            self._step_fn = jax.jit(self.train_step, donate_argnums=(0,)).lower(
                state, batch).compile()
        except REFUSED as e:
            if self.kind != "jax_fp8":
                raise
            raise Skip(f"{type(e).__name__}: {e}") from e
        return self._step_fn, time.perf_counter() - t

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
        """[n probed, 3]: per probed layer's incoming gradient, its underflow fraction in
        the run's gradient FP8 type with the scale the run quantizes it with this step (NaN
        where it has none) and with the current per-tensor scale (max of the type / amax),
        and its amax."""
        rows = []
        dtype = jnp.dtype(self.spec.grad_dtype)
        for _, i, name in probed_layers(self.cfg):
            grad = pgrads[f"block_{i}"][f"{name}_grad"].astype(jnp.float32)
            amax = jnp.max(jnp.abs(grad))
            current = jnp.where(amax > 0, float(jnp.finfo(dtype).max) / amax, 1.0)
            own = fp8_scale_of(self.kind, state, i, name, "grad")
            rows.append(jnp.stack([underflow_fraction(grad, own[1], dtype) if own else jnp.nan,
                                   underflow_fraction(grad, current, dtype), amax]))
        return jnp.stack(rows).astype(jnp.float32)

    def train_step(self, state, batch):
        loss, grads, fp8_grads, pgrads = self._loss_and_grads(state, batch)
        # Every probe_every steps (state.step is the step being taken): the underflow
        # fractions, from the state's scales before this step's FP8-state update.
        n = len(probed_layers(self.cfg))
        underflow = jax.lax.cond(
            state.step % self.cfg.probe_every == 0,
            lambda: self.underflow(state, pgrads),
            lambda: jnp.full((n, 3), jnp.nan, jnp.float32))
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

    def close(self):
        if self.bar is not None:
            self.bar.close()


def log(msg):
    print(msg, file=sys.stderr, flush=True)


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
            if vs is None:
                return "—"
            st = vs[key]
            return f"{_pm(st, '+.2f', ' %')} (n={st['n']})" if st["n"] else "no bf16 seed"
        def interval(key):
            st = (vs or {}).get(key)
            if not st or st["ci95"] is None:
                return "—"
            lo, hi = st["mean"] - st["ci95"], st["mean"] + st["ci95"]
            return f"{lo:+.2f} … {hi:+.2f} %"
        tok = e["tokens_per_s"]
        tok_text = f"{tok['mean'] / 1e3:.1f}k" if tok["n"] else "—"
        lines.append(f"| `{name}` | {len(e['seeds'])} | {_pm(e['final_val_loss'])} | "
                     f"{_pm(e['tail_val_loss'])} | {paired('final_val_loss')} | "
                     f"{interval('final_val_loss')} | {paired('tail_val_loss')} | {_pm(e['tail_train_loss'])} | "
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
    fig, axes = plt.subplots(1, 3, figsize=(16.5, 4.6))
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
            ax.legend(fontsize=7, loc="upper right")
    axes[0].set_title("train loss (nats/byte, block means)")
    axes[1].set_title("validation loss (nats/byte); grey: the averaged last part")
    axes[2].axhline(0, color="k", lw=0.6)
    axes[2].set_title("validation loss vs bf16 of the same seed (%)")
    fig.suptitle(_title(summary), fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.12, top=0.86, wspace=0.22)
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
    fig, axes = plt.subplots(1, 3, figsize=(16.5, 4.6))
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
                      "(delayed: its scale; current and bf16: max / amax)", fontsize=9)
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
    fig.suptitle(_title(summary).split(";")[0] + f"; seed {seed}", fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.12, top=0.86, wspace=0.22)
    path = out / "fp8.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


# ----------------------------------------------------------------------------- main

def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
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
