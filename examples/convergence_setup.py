"""The convergence study's configuration, runs, model, data and one run's train state and step
(examples/convergence.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import platform
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any

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

FP8_COLLECTION = "fp8_meta"
FLAX_OWG = getattr(flax_fp8_ops, "OVERWRITE_WITH_GRADIENT", "_overwrite_with_gradient")
FLAX_OP = getattr(flax_fp8_ops, "Fp8DirectDotGeneralOp", None)
REFERENCE = "bf16"


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

def log(msg):
    print(msg, file=sys.stderr, flush=True)
