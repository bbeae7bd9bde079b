#!/usr/bin/env python3
"""Benchmark: a Llama-style decoder's training step, bf16 vs Flax FP8 vs jax_fp8's recipes.

The model (plain Flax linen, written here): token embedding; per block RMSNorm, fused QKV
projection, rotary position embedding, causal attention (``jax.nn.dot_product_attention``,
cuDNN on a GPU), output projection, residual; RMSNorm, fused gate/up projection, SwiGLU,
down projection, residual; final RMSNorm, LM head, cross-entropy; ``optax.adamw``; float32
parameters, bf16 compute, the train state donated, the blocks unrolled (``--scan``:
``nn.scan``). The four projections of each block are the FP8 GEMMs; the LM head stays
bf16 (``--fp8-lm-head`` makes it FP8 too). Sizes (SIZES below):

  tiny      d 128, 2 heads, ffn 256, 2 blocks, 2 x 64 tokens, vocab 512 (CPU, seconds)
  350m      d 1024, 16 heads, ffn 2816, 24 blocks, 8 x 2048 tokens, vocab 32000
  1b        d 2048, 16 heads, ffn 5632, 16 blocks, 4 x 2048 tokens, vocab 32000
  8b_slice  d 4096, 32 heads, ffn 14336, 4 blocks, 2 x 4096 tokens, vocab 32000

Variants (VARIANTS below; a new one, e.g. with fused kernels, is one entry):

  bf16              nn.Dense
  flax_fp8          nn.Dense(dot_general_cls=flax.linen.fp8_ops.Fp8DirectDotGeneralOp),
                    the FP8 variables in Flax's "_overwrite_with_gradient" collection,
                    written by flax.training's TrainState.apply_gradients
  jax_fp8_delayed   nn.Dense(dot_general_cls=jax_fp8.flax.Fp8DotGeneral) + Fp8TrainState,
                    DelayedScaling
  jax_fp8_current   the same with Float8CurrentScaling
  jax_fp8_block     the same with Float8BlockScaling

and, run only when named, jax_fp8_delayed with one piece of its layout work handed back
to XLA's own ops (XLA_PIECES below), to measure what each of its kernels saves:

  jax_fp8_delayed_xla_gradient_cast     the incoming gradient's FP8 copy and amax by XLA
                                        (fused into the gradient's producer), not the
                                        quantize + transpose kernel
  jax_fp8_delayed_xla_kernel_rotation   the forward GEMM's FP8 kernel transposed by XLA
  jax_fp8_delayed_xla_layouts           no layout kernel at all: every FP8 transpose and
                                        the gradient's cast by XLA

Each variant runs in its own process (this script with --worker), so its compile is a
cold one and no variant sees another's autotuning. Per size and variant: device time per
step (the sum of the GPU kernel durations in a profiler trace of --steps steps / steps),
split by kernel family (FP8 GEMM, bf16 GEMM, attention, norm+quantize, act+quantize,
quantize/transpose, amax, jax_fp8 kernels, other; FAMILY_NOTE below); pipelined wall time (--steps steps
dispatched back to back, one block at the end) and blocked wall time (the median of
--steps steps each followed by block_until_ready), after --warmup steps; tokens/s; lower
+ compile time; ``compiled.memory_analysis().temp_size_in_bytes``; the speed-ups vs bf16
and vs Flax FP8; and each FP8 variant's floor: its own GEMM time + bf16's attention time +
bf16's other (non-GEMM, non-attention) time, i.e. the step if FP8 added nothing but its
GEMMs. On a CPU there are no GPU kernels: device time is reported unavailable, the XLA:CPU
op time by family stands in for the family split, and the wall times are measured.

Progress goes to stderr, the markdown report to stdout; OUTDIR/results.json,
OUTDIR/results.md and OUTDIR/plot.png are rewritten after every variant (an interrupted
run keeps what it measured).

Examples:
  python bench/bench_llm.py --outdir out/bench_llm                  # 1b and 8b_slice, 5 variants
  python bench/bench_llm.py --sizes 8b_slice --variants bf16,jax_fp8_delayed --steps 20
  python bench/bench_llm.py --sizes tiny --variants bf16,jax_fp8_delayed --steps 2   # CPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import fp8_ops
from flax.training import train_state

import common
import jax_fp8
from jax_fp8.devtools import compilation, hlo, trace
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8TrainState

# --------------------------------------------------------------------------------------
# Sizes.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Size:
    """A decoder's shape and its batch: width ``d``, ``heads`` (head dim d / heads), SwiGLU
    width ``ffn``, ``layers`` blocks, ``batch`` x ``seq`` tokens, ``vocab``."""

    name: str
    d: int
    heads: int
    ffn: int
    layers: int
    batch: int
    seq: int
    vocab: int = 32000

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    def matmul_params(self) -> int:
        """Parameters of the GEMMs: four projections per block and the LM head."""
        return self.layers * (4 * self.d * self.d + 3 * self.d * self.ffn) + self.d * self.vocab

    def params(self) -> int:
        """All parameters: the GEMMs', the embedding and the norms' scales."""
        return self.matmul_params() + self.vocab * self.d + (2 * self.layers + 1) * self.d

    def flops_per_step(self) -> float:
        """Model FLOPs of one training step: 6 per GEMM parameter and token, plus the
        attention products (QK^T and PV, forward and backward) at half for the causal mask."""
        return self.tokens * (6.0 * self.matmul_params() + 6.0 * self.layers * self.d * self.seq)


SIZES = {s.name: s for s in (
    Size("tiny", 128, 2, 256, 2, 2, 64, vocab=512),
    Size("350m", 1024, 16, 2816, 24, 8, 2048),
    Size("1b", 2048, 16, 5632, 16, 4, 2048),
    Size("8b_slice", 4096, 32, 14336, 4, 2, 4096),
)}
DEFAULT_SIZES = ("1b", "8b_slice")


# --------------------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------------------

dense = functools.partial(nn.Dense, use_bias=False, dtype=jnp.bfloat16,
                          param_dtype=jnp.float32)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * scale, in float32, returned in bf16."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(jnp.bfloat16)


class NormDense(nn.Module):
    """RMSNorm, then a bias-free projection: the pair a fused norm+quantize kernel
    replaces."""

    features: int
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x):
        h = RMSNorm(name="norm")(x)
        return dense(self.features, dot_general_cls=self.dot_general_cls, name="proj")(h)


class SwiGLUDown(nn.Module):
    """silu(gate) * up from the fused gate/up output ``[..., 2 * ffn]``, then the down
    projection: the pair a fused activation+quantize kernel replaces."""

    features: int
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, gate_up):
        gate, up = jnp.split(gate_up, 2, axis=-1)
        h = nn.silu(gate) * up
        return dense(self.features, dot_general_cls=self.dot_general_cls, name="proj")(h)


def apply_rope(x, positions):
    """Rotary position embedding of ``x`` [batch, seq, heads, head_dim] (halves rotated)."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]      # [seq, half]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                           axis=-1).astype(x.dtype)


class Block(nn.Module):
    """One decoder block on the residual stream ``x`` [batch * seq, d] (2-D, so every
    projection is a plain [tokens, K] x [K, N] GEMM)."""

    size: Size
    layers: Any          # Layers
    rope: bool = True

    @nn.compact
    def __call__(self, x, _=None):
        s, lay = self.size, self.layers
        qkv = lay.norm_dense(3 * s.d, lay.dot_general_cls, name="attn_in")(x)
        qkv = qkv.reshape(s.batch, s.seq, 3, s.heads, s.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.rope:
            pos = jnp.arange(s.seq)
            q, k = apply_rope(q, pos), apply_rope(k, pos)
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                           implementation=lay.attention)
        att = att.reshape(s.tokens, s.d)
        x = x + dense(s.d, dot_general_cls=lay.dot_general_cls, name="attn_out")(att)
        gate_up = lay.norm_dense(2 * s.ffn, lay.dot_general_cls, name="mlp_in")(x)
        x = x + lay.act_dense(s.d, lay.dot_general_cls, name="mlp_out")(gate_up)
        return x, None


class Decoder(nn.Module):
    """Tokens [batch, seq] -> logits [batch * seq, vocab] (bf16)."""

    size: Size
    layers: Any          # Layers
    scan: bool = False
    rope: bool = True

    @nn.compact
    def __call__(self, tokens):
        s, lay = self.size, self.layers
        x = nn.Embed(s.vocab, s.d, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                     embedding_init=nn.initializers.normal(0.02),
                     name="embed")(tokens.reshape(-1))
        if self.scan:
            axes = {c: 0 for c in ("params", *lay.stacked_collections)}
            blocks = nn.scan(Block, variable_axes=axes, split_rngs={"params": True},
                             length=s.layers)
            x, _ = blocks(s, lay, self.rope, name="blocks")(x, None)
        else:
            for i in range(s.layers):
                x, _ = Block(s, lay, self.rope, name=f"block{i}")(x)
        x = RMSNorm(name="final_norm")(x)
        return dense(s.vocab, dot_general_cls=lay.head_dot_general_cls, name="lm_head")(x)


@dataclasses.dataclass(frozen=True)
class Layers:
    """What a variant puts into the model. ``dot_general_cls``: the four projections'
    (None: ``lax.dot_general``); ``head_dot_general_cls``: the LM head's; ``norm_dense`` /
    ``act_dense``: (features, dot_general_cls, name=) -> the module for RMSNorm +
    projection / SwiGLU + down projection (None: the unfused NormDense / SwiGLUDown);
    ``attention``: ``jax.nn.dot_product_attention``'s implementation; ``stacked_collections``:
    the variable collections other than "params" that ``--scan`` stacks per block."""

    dot_general_cls: Any = None
    head_dot_general_cls: Any = None
    norm_dense: Any = None
    act_dense: Any = None
    attention: str | None = None
    stacked_collections: tuple = ()

    def resolved(self) -> "Layers":
        return dataclasses.replace(self, norm_dense=self.norm_dense or NormDense,
                                   act_dense=self.act_dense or SwiGLUDown)


# --------------------------------------------------------------------------------------
# Variants.
# --------------------------------------------------------------------------------------

FLAX_OP = getattr(fp8_ops, "Fp8DirectDotGeneralOp", None) or fp8_ops.Fp8DotGeneralOp
FLAX_OWG = getattr(fp8_ops, "OVERWRITE_WITH_GRADIENT", "_overwrite_with_gradient")


def _flax_layers(args):
    return Layers(dot_general_cls=functools.partial(FLAX_OP, amax_history_length=args.history_len),
                  stacked_collections=(FLAX_OWG,))


def _jax_fp8_layers(recipe):
    return Layers(dot_general_cls=functools.partial(Fp8DotGeneral, recipe=recipe),
                  stacked_collections=(FP8_COLLECTION,))


def _delayed(args):
    return jax_fp8.DelayedScaling(history_len=args.history_len)


def _current(args):
    return jax_fp8.Float8CurrentScaling()


def _block(args):
    return jax_fp8.Float8BlockScaling()


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the step. ``kind`` ("bf16", "flax" or "jax_fp8") picks the train
    state and step; ``recipe``: args -> the jax_fp8 recipe (kind "jax_fp8"); ``layers``:
    args -> `Layers` (default: by kind, from the recipe); ``update_calls``: the
    ``jax_fp8_update`` custom calls the compiled step must hold (None: not checked);
    ``xla_pieces``: pieces of jax_fp8's own layout work handed back to XLA's ops in the
    worker (`XLA_PIECES`), to measure what each of its kernels saves."""

    name: str
    label: str
    kind: str
    recipe: Callable | None = None
    layers: Callable | None = None
    update_calls: int | None = None
    xla_pieces: tuple = ()

    def make_layers(self, args) -> Layers:
        if self.layers is not None:
            lay = self.layers(args)
        elif self.kind == "flax":
            lay = _flax_layers(args)
        elif self.kind == "jax_fp8":
            lay = _jax_fp8_layers(self.recipe(args))
        else:
            lay = Layers()
        head = lay.dot_general_cls if args.fp8_lm_head else lay.head_dot_general_cls
        return dataclasses.replace(lay, head_dot_general_cls=head,
                                   attention=attention_impl(args)).resolved()


# The pieces of jax_fp8's layout work a variant can hand back to XLA's own ops: each is
# (module, private function, replacement), replaced in the worker process. The library needs
# no switch for them: the kernels compute the bits of the XLA ops they stand for
# (tests/test_layout_kernels.py). The whole step may still differ in its last bits: XLA
# picks its own fusions and GEMM algorithms for the other program, and fused into the
# kernel that produces the gradient its cast may read the gradient's unrounded float32
# value (its default --xla_allow_excess_precision).
XLA_PIECES = {
    # fp8_dot_general's backward: the gradient's FP8 copy and amax as XLA's ops (which XLA
    # fuses into the kernel that produces the gradient), its transposed copy by the byte
    # transpose, instead of the quantize + transpose kernel's one pass.
    "gradient_cast": ("jax_fp8._primitives.layout", "quantize_rotate_applies",
                      lambda x, fp8_dtype: False),
    # The forward GEMM's FP8 kernel left as stored: XLA casts it into a transpose for the
    # forward GEMM and transposes it back for the input gradient's.
    "kernel_rotation": ("jax_fp8._gemms", "rhs_for_forward",
                        lambda q_rhs, dimension_numbers: (q_rhs, dimension_numbers)),
    # Neither layout kernel takes any size: every FP8 transpose, and the gradient's
    # quantize + transpose + amax, lower to XLA's own ops.
    "layout_kernels": ("jax_fp8._primitives.layout", "kernel_takes", lambda rows, cols: False),
}


def hand_to_xla(piece):
    """Replaces the library function behind ``piece`` (`XLA_PIECES`) in this process."""
    module_name, name, replacement = XLA_PIECES[piece]
    module = importlib.import_module(module_name)
    if not callable(getattr(module, name, None)):
        raise AttributeError(f"{module_name}.{name} is gone: update XLA_PIECES[{piece!r}]")
    setattr(module, name, replacement)


VARIANTS = {v.name: v for v in (
    Variant("bf16", "bf16", "bf16"),
    Variant("flax_fp8", f"Flax FP8 ({FLAX_OP.__name__})", "flax"),
    Variant("jax_fp8_delayed", "jax_fp8 delayed", "jax_fp8", _delayed, update_calls=1),
    Variant("jax_fp8_current", "jax_fp8 current", "jax_fp8", _current),
    Variant("jax_fp8_block", "jax_fp8 block", "jax_fp8", _block),
    Variant("jax_fp8_delayed_xla_gradient_cast", "jax_fp8 delayed, gradient cast by XLA",
            "jax_fp8", _delayed, update_calls=1, xla_pieces=("gradient_cast",)),
    Variant("jax_fp8_delayed_xla_kernel_rotation", "jax_fp8 delayed, kernel rotated by XLA",
            "jax_fp8", _delayed, update_calls=1, xla_pieces=("kernel_rotation",)),
    Variant("jax_fp8_delayed_xla_layouts", "jax_fp8 delayed, no layout kernels", "jax_fp8",
            _delayed, update_calls=1, xla_pieces=("layout_kernels",)),
)}
# The three variants with a piece handed back to XLA run only when named (--variants).
DEFAULT_VARIANTS = tuple(name for name, v in VARIANTS.items() if not v.xla_pieces)


def attention_impl(args):
    """``jax.nn.dot_product_attention``'s implementation: --attention, else cuDNN on a GPU
    and XLA elsewhere."""
    if args.attention != "auto":
        return args.attention
    return "cudnn" if common.platform_name() == "gpu" else "xla"


# --------------------------------------------------------------------------------------
# Train states and steps.
# --------------------------------------------------------------------------------------

def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels.reshape(-1)).mean()


def make_model(variant, size, args):
    return Decoder(size, variant.make_layers(args), scan=args.scan, rope=not args.no_rope)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _normal(key, std, shape, dtype):
    return jax.random.normal(key, shape, dtype) * std.astype(dtype)


def init_params(shapes, key):
    """Parameters of the shapes ``shapes`` (a tree of ShapeDtypeStruct): norm scales ones,
    the embedding N(0, 0.02^2), every kernel N(0, 1 / fan_in). Drawn leaf by leaf, so one
    small program per distinct shape is compiled, where a jitted ``model.init`` compiles
    every initializer of the unrolled model (tens of seconds on a GPU for the 1b size)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for (path, leaf), k in zip(leaves, jax.random.split(key, len(leaves))):
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 1 or "scale" in name:
            out.append(jnp.ones(leaf.shape, leaf.dtype))
            continue
        std = 0.02 if "embedding" in name else 1.0 / math.sqrt(leaf.shape[-2])
        out.append(_normal(k, np.float32(std), leaf.shape, np.dtype(leaf.dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)


def init_variables(model, tokens, seed):
    """The model's variables: the parameters from `init_params`, the other collections (the
    FP8 states) from the model's own initializers (one jitted init whose parameters are
    dead code, so XLA drops their initializers)."""
    key = jax.random.key(seed)
    param_shapes = {}

    def other_collections(k, t):
        variables = model.init(k, t)
        param_shapes["params"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                              variables["params"])   # (traced once)
        return {c: v for c, v in variables.items() if c != "params"}
    rest = jax.jit(other_collections)(key, tokens)
    return {"params": init_params(param_shapes["params"], key), **rest}


def make_state(variant, size, args, tokens):
    """A fresh train state (parameters from ``args.seed``, the same for every variant)."""
    model = make_model(variant, size, args)
    variables = init_variables(model, tokens, args.seed)
    tx = optax.adamw(args.lr, weight_decay=0.1)
    if variant.kind == "bf16":
        return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                             tx=tx)
    if variant.kind == "flax":
        return train_state.TrainState.create(
            apply_fn=model.apply, tx=tx,
            params={"params": variables["params"], FLAX_OWG: variables[FLAX_OWG]})
    return jax_fp8_state(model, variables, tx, variant.recipe(args))


def jax_fp8_state(model, variables, tx, recipe):
    """jax_fp8's train state for ``variables`` (params and the FP8 collection)."""
    return Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=tx, recipe=recipe)


def plain_step(state, tokens, labels):
    """bf16, and Flax FP8: the gradients of Flax's "_overwrite_with_gradient" collection ARE
    its new FP8 variables, which TrainState.apply_gradients writes (adamw sees "params")."""
    def loss_fn(variables):
        v = variables if FLAX_OWG in variables else {"params": variables}
        return xent(state.apply_fn(v, tokens), labels)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def jax_fp8_step(state, tokens, labels):
    """jax_fp8's step: the gradient w.r.t. params and the FP8 state ({"params": ...,
    "fp8_meta": ...}); adamw on the former, one fused update of the latter."""
    def loss_fn(params, fp8):
        return xent(state.apply_model(params, fp8, tokens), labels)
    loss, grads = state.value_and_grad(loss_fn)()
    return state.apply_gradients(grads=grads), loss


def step_function(variant):
    return jax_fp8_step if variant.kind == "jax_fp8" else plain_step


# --------------------------------------------------------------------------------------
# Kernel families: from the compiled HLO (fusion bodies, custom-call targets, GEMM operand
# types) and, for library kernels the trace names otherwise, from the kernel's name.
# --------------------------------------------------------------------------------------

FAMILIES = ("fp8_gemm", "bf16_gemm", "attention", "norm_quantize", "act_quantize",
            "quantize_transpose", "amax", "jax_fp8_kernels", "optimizer", "other")
FAMILY_LABELS = {"fp8_gemm": "FP8 GEMM", "bf16_gemm": "bf16 GEMM", "attention": "attention",
                 "norm_quantize": "norm+quantize", "act_quantize": "act+quantize",
                 "quantize_transpose": "quantize/transpose",
                 "amax": "amax", "jax_fp8_kernels": "jax_fp8 kernels",
                 "optimizer": "optimizer", "other": "other"}
GEMM_FAMILIES = ("fp8_gemm", "bf16_gemm")
FAMILY_NOTE = (
    "Kernel families: FP8 GEMM / bf16 GEMM (a GEMM with FP8 operands / any other GEMM: the "
    "compiled HLO's dots and GEMM custom calls, cuBLASLt's `nvjet_*` kernels by the operand "
    "types in their name); attention (cuDNN's fused attention); norm+quantize and act+quantize (a "
    "fusion that writes FP8 or takes a max-of-abs amax, with an RMSNorm's or the SwiGLU's "
    "ops in it, by the HLO's op_name scopes); quantize/transpose (other fusions, copies and "
    "transposes that write FP8, or transpose FP8 data); amax (other fusions with a max-of-abs "
    "reduction); jax_fp8 kernels (jax_fp8's own CUDA kernels other than its GEMM); optimizer "
    "(a fusion whose largest output is computed outside the model's forward and backward, "
    "i.e. with no `jvp(` in its op_name: adamw's update, with any weight amax that XLA reads "
    "in the same pass); other (everything else: bf16 norms and activations, residual adds, "
    "RoPE, softmax and cross-entropy, the embedding, copies).")
FLOOR_NOTE = (
    "Floor of an FP8 variant: its own GEMM time (FP8 GEMMs and any bf16 GEMM left, e.g. the "
    "LM head) + bf16's attention time + bf16's other time (everything but GEMMs and "
    "attention): the step if FP8 cost nothing beyond its GEMMs. FP8 overhead: the "
    "variant's time outside GEMMs and attention minus bf16's.")

_CALLS = re.compile(r"\b(?:calls|to_apply)=(\{[^}]*\}|%?[\w.\-]+)")
_F8 = re.compile(r"\bf8e\w*\[")
_NVJET_TYPES = re.compile(r"nvjet_(?:sm\d+_)?([a-z]+)_")
_GEMM_NAME = re.compile(r"nvjet|cublas|cutlass|xmma|gemm|matmul", re.I)
_FP8_NAME = re.compile(r"e4m3|e5m2|f8e|fp8|float8", re.I)
_ATTENTION_NAME = re.compile(r"cudnn|fmha|sdpa|flash", re.I)
_OWN_NAME = re.compile(r"jax_fp8::")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# The model's module scopes in the HLO's op_name metadata: its RMSNorms ("norm",
# "final_norm") and SwiGLU (in "mlp_out", outside its projection "proj").
_NORM_SCOPE = re.compile(r"/\w*norm/")
_ACT_SCOPE = re.compile(r"/mlp_out/(?!proj/)")
# The model's forward and backward: every op_name under jax.value_and_grad has "jvp(" in
# it ("jvp(Decoder)", "transpose(jvp(Decoder))"); the optimizer's ops do not.
_MODEL_SCOPE = re.compile(r"\bjvp\(")


def _callees(line: str) -> list[str]:
    out = []
    for group in _CALLS.findall(line):
        out += re.findall(r"%?([\w.\-]+)", group)
    return out


def _body(mod, ins, depth=0) -> list:
    """The instructions of the computations ``ins`` calls, recursively (a fusion's body)."""
    out = []
    for c in _callees(ins.line):
        for i in mod.computations.get(c, ()):
            out.append(i)
            if depth < 8:
                out += _body(mod, i, depth + 1)
    return out


def _largest_output_outside_model(mod, ins) -> bool:
    """Whether the largest output of fusion ``ins`` is computed outside the model's forward
    and backward (its op_name has no ``jvp(``): the optimizer's update."""
    for callee in _callees(ins.line):
        body = mod.computations.get(callee, ())
        root = next((i for i in body if i.line.lstrip().startswith("ROOT")), None)
        if root is None:
            continue
        outputs = [root]
        if root.opcode == "tuple":
            by_name = {i.name: i for i in body}
            outputs = [by_name[n] for n in hlo.operands(root) if n in by_name]
        if not outputs:
            continue
        largest = max(outputs, key=lambda i: hlo.shape_bytes(i.shape))
        names = _OP_NAME.findall(largest.line)
        return bool(names) and not _MODEL_SCOPE.search(names[0])
    return False


def _fusion_family(mod, ins) -> str:
    body = _body(mod, ins)
    ops = {i.opcode for i in body}
    scopes = " ".join(m for i in body for m in _OP_NAME.findall(i.line))
    writes_fp8 = bool(_F8.search(ins.shape)) or any(
        i.opcode == "convert" and _F8.search(i.shape) for i in body)
    reads_fp8 = any(i.opcode == "parameter" and _F8.search(i.shape) for i in body)
    amax = "abs" in ops and any(
        i.opcode == "reduce" and any(j.opcode == "maximum"
                                     for c in _callees(i.line) for j in mod.computations.get(c, ()))
        for i in body)
    if writes_fp8 or amax:
        if "rsqrt" in ops or _NORM_SCOPE.search(scopes):
            return "norm_quantize"
        if _ACT_SCOPE.search(scopes):
            return "act_quantize"
    if _largest_output_outside_model(mod, ins):
        return "optimizer"
    if writes_fp8 or (reads_fp8 and ("transpose" in ops or "transpose" in ins.name)):
        return "quantize_transpose"
    return "amax" if amax else "other"


def hlo_families(program, gemms=None) -> dict[str, str]:
    """{kernel name (`hlo.kernel_name`): family} of every kernel-level instruction
    (``gemms``: `hlo.gemms` of the program, where already found)."""
    mod = hlo.parse(program)
    gemms = hlo.gemms(mod) if gemms is None else gemms
    out = {hlo.kernel_name(g.name): "fp8_gemm" if g.fp8 else "bf16_gemm" for g in gemms}
    for ins in hlo.kernel_instructions(mod):
        key = hlo.kernel_name(ins.name)
        if key in out:
            continue
        if ins.opcode == "custom-call":
            target = (re.search(r'custom_call_target="([^"]+)"', ins.line) or [None, ""])[1]
            if _ATTENTION_NAME.search(target):
                out[key] = "attention"
            elif target.startswith("jax_fp8_block_gemm"):
                out[key] = "fp8_gemm"
            elif target.startswith("jax_fp8"):
                out[key] = "jax_fp8_kernels"
            else:
                out[key] = "other"
        elif ins.opcode == "fusion":
            out[key] = _fusion_family(mod, ins)
        elif ins.opcode in ("copy", "transpose") and _F8.search(ins.shape):
            out[key] = "quantize_transpose"
        else:
            out[key] = "other"
    return out


def _gemm_name_fp8(name: str):
    """True/False where a GEMM kernel's name says whether its operands are FP8 (cuBLASLt's
    ``nvjet_sm90_qqtst_...``: q = E4M3, r = E5M2; ``..._tst_...``: bf16), else None."""
    if _FP8_NAME.search(name):
        return True
    m = _NVJET_TYPES.search(name)
    return None if m is None else bool(set(m.group(1)) & set("qr"))


def event_family(event, families) -> tuple[str, str]:
    """(family, how it was decided) of one trace event, ``families`` from `hlo_families`."""
    name = str(event.get("name", ""))
    hlo_op = (event.get("args") or {}).get("hlo_op")
    key = hlo.kernel_name(name)
    if key in families:
        return families[key], "hlo name"
    if _OWN_NAME.search(name):
        return ("fp8_gemm" if "BlockGemm" in name else "jax_fp8_kernels"), "kernel name"
    by_op = families.get(hlo.kernel_name(str(hlo_op))) if hlo_op else None
    if _ATTENTION_NAME.search(name):
        return "attention", "kernel name"
    if _GEMM_NAME.search(name):
        fp8 = _gemm_name_fp8(name)
        if fp8 is None:
            fp8 = by_op == "fp8_gemm"
        return ("fp8_gemm" if fp8 else "bf16_gemm"), "kernel name"
    if by_op:
        return by_op, "hlo_op"
    return "other", "unmatched"


def split_by_family(events, families, steps, top, kernel_bytes=None):
    """({family: ms per step}, {how decided: events}, top kernels, {family: bandwidth}) of
    the traced events. ``kernel_bytes``: `hlo.kernel_bytes` of the program; the kernels XLA
    names after an HLO instruction (fusions, copies) then get the bytes they move and the
    TB/s that makes, and each family the TB/s of those kernels together ("tb_per_s") and
    the share of the family's time they are ("of_time"). Custom calls' kernels (GEMMs,
    attention, jax_fp8's) are named by their library and get none."""
    kernel_bytes = kernel_bytes or {}
    ms = dict.fromkeys(FAMILIES, 0.0)
    how = collections.Counter()
    per_kernel: dict = {}
    moved = collections.Counter()     # family: bytes of the kernels with known bytes
    timed = collections.Counter()     # family: their time, us
    for e in events:
        fam, decided = event_family(e, families)
        dur = float(e.get("dur", 0.0))
        ms[fam] += dur / steps / 1e3
        how[decided] += 1
        name = str(e.get("name", "?"))
        slot = per_kernel.setdefault(name, [fam, 0, 0.0, kernel_bytes.get(hlo.kernel_name(name))])
        slot[1] += 1
        slot[2] += dur
        if slot[3] is not None:
            moved[fam] += slot[3]
            timed[fam] += dur
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][2])[:top]
    top_kernels = []
    for k, (f, n, us, nbytes) in ranked:
        entry = {"name": k[:160], "family": f, "per_step": n / steps,
                 "ms_per_step": round(us / steps / 1e3, 5)}
        if nbytes is not None:
            entry["bytes"] = nbytes
            entry["tb_per_s"] = round(nbytes * n / (us * 1e-6) / 1e12, 3) if us else None
        top_kernels.append(entry)
    bandwidth = {f: {"tb_per_s": round(moved[f] / (timed[f] * 1e-6) / 1e12, 3),
                     "of_time": round(timed[f] / steps / 1e3 / ms[f], 3)}
                 for f in FAMILIES if timed[f] and ms[f]}
    return {k: round(v, 5) for k, v in ms.items()}, dict(how), top_kernels, bandwidth


# --------------------------------------------------------------------------------------
# One variant at one size, in this process (--worker).
# --------------------------------------------------------------------------------------

def log(msg):
    print(msg, file=sys.stderr, flush=True)


def gemm_info(mod, gemms) -> dict[str, dict]:
    """{kernel name: {"fp8", "kind", "role", "dtypes", "batch", "m", "n", "k"}} of the step's
    GEMMs (`hlo.gemms`, `hlo.gemm_sizes`; kind: `hlo.Gemm`'s); role "backward" where the GEMM's op_name is under a
    ``transpose(`` (JAX's name for the backward pass), else "forward"; dtypes: its two
    operands' element types (e.g. ``["f8e5m2", "f8e4m3fn"]``)."""
    kernels = {i.name: i for i in hlo.kernel_instructions(mod)}
    shapes = {i.name: i.shape for comp in mod.computations.values() for i in comp}
    sizes = hlo.gemm_sizes(mod)
    out = {}
    for g in gemms:
        ins = kernels.get(g.name)
        op_name = re.search(r'op_name="([^"]*)"', ins.line if ins else "")
        dtypes = [re.match(r"\(?\s*([a-z][a-z0-9]*)\[", shapes.get(op.partition("#")[0], ""))
                  for op in (hlo.gemm_operands(ins) if ins else [])]
        entry = {"fp8": g.fp8, "kind": g.kind,
                 "role": "backward" if op_name and "transpose(" in op_name.group(1) else "forward",
                 "dtypes": [m.group(1) if m else None for m in dtypes]}
        if g.name in sizes:
            entry.update(sizes[g.name]._asdict())
        out[hlo.kernel_name(g.name)] = entry
    return out


def gemm_table(events, gemms, steps) -> dict:
    """The traced GEMM kernels by shape: {"rows": [{fp8, role, batch, m, n, k, per_step,
    ms_per_step, tflops}], "unattributed_ms": ..., "attributed_by": ...}.

    A kernel event is attributed to the GEMM its ``hlo_op`` names (``gemms`` from
    `gemm_info`, in the compiled program's order). Where no event names one (kernels
    launched from a command buffer carry no ``hlo_op``) and the trace has exactly one GEMM
    kernel per GEMM of the program per step, each in time order is the GEMM at the same
    place in the program's order, provided every kernel's name agrees with its GEMM on
    FP8 or not ("order"). GEMM kernels left over are summed unattributed."""
    named, is_gemm = [], []
    for e in events:
        hlo_op = (e.get("args") or {}).get("hlo_op")
        info = gemms.get(hlo.kernel_name(str(hlo_op))) if hlo_op else None
        name = str(e.get("name", ""))
        if _is_gemm_kernel(name):
            is_gemm.append(e)
        elif info is None:
            continue
        named.append((e, info))
    how = "hlo_op"
    if not any(info for _, info in named) and is_gemm:
        by_order = _gemms_by_order(is_gemm, list(gemms.values()), steps)
        if by_order is not None:
            named, how = by_order, "order"
    groups: dict = {}
    unattributed = 0.0
    for e, info in named:
        if info is None:
            unattributed += float(e.get("dur", 0.0))
            continue
        key = tuple(info.get(f) for f in ("fp8", "kind", "role", "batch", "m", "n", "k")) + (
            tuple(info.get("dtypes") or ()),)
        slot = groups.setdefault(key, [0, 0.0])
        slot[0] += 1
        slot[1] += float(e.get("dur", 0.0))
    rows = []
    for (fp8, kind, role, batch, m, n, k, dtypes), (count, us) in sorted(
            groups.items(), key=lambda kv: -kv[1][1]):
        flops = 2 * batch * m * n * k if None not in (batch, m, n, k) else None
        rows.append({"fp8": fp8, "kind": kind, "role": role, "dtypes": list(dtypes), "batch": batch, "m": m,
                     "n": n, "k": k,
                     "per_step": count / steps, "ms_per_step": round(us / steps / 1e3, 5),
                     "tflops": flops * count / (us * 1e-6) / 1e12 if flops and us else None})
    return {"rows": rows, "unattributed_ms": round(unattributed / steps / 1e3, 5),
            "attributed_by": how if groups else None}


def _is_gemm_kernel(name: str) -> bool:
    """Whether `event_family` names a kernel a GEMM's by its name alone."""
    return event_family({"name": name}, {})[0] in ("fp8_gemm", "bf16_gemm")


def _gemms_by_order(gemm_events, infos, steps):
    """[(event, info)] pairing the GEMM kernels in time order with the program's GEMMs in
    its order, step after step; None unless the counts match and every kernel's name
    agrees with its GEMM on FP8 or not (`gemm_table`)."""
    if not infos or len(gemm_events) != steps * len(infos):
        return None
    ordered = sorted(gemm_events, key=lambda e: float(e.get("ts", 0.0)))
    pairs = [(e, infos[i % len(infos)]) for i, e in enumerate(ordered)]
    for e, info in pairs:
        fp8 = _gemm_name_fp8(str(e.get("name", "")))
        if fp8 is not None and fp8 != bool(info.get("fp8")):
            return None
    return pairs


_HLO_DTYPES = {"f8e4m3fn": jnp.float8_e4m3fn, "f8e5m2": jnp.float8_e5m2}


def time_fp8_gemm_alone(g, steps, seed=0) -> dict:
    """One FP8 GEMM row of `gemm_table` timed on its own, the way jax_fp8 runs it
    (``_gemms.gemm``: both operands contracted over their minor axis, a bfloat16 result,
    cuBLASLt's algorithm as XLA autotunes it for that GEMM alone): {"tflops": with the
    row's accumulation (fast for a forward GEMM, float32 for a backward one),
    "tflops_other_accumulation": with the other}. GPU kernel time of ``steps`` calls."""
    from jax_fp8 import _gemms
    if g.get("batch") != 1 or None in (g.get("m"), g.get("n"), g.get("k")) \
            or not str(g.get("kind", "")).startswith("__cublas"):
        return {}   # (a block-scaled GEMM is not a per-tensor one)
    dtypes = [_HLO_DTYPES.get(d) for d in g.get("dtypes") or ()]
    if len(dtypes) != 2 or None in dtypes:
        return {}
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.normal(size=(g["m"], g["k"])).astype(np.float32)).astype(dtypes[0])
    b = jnp.asarray(rng.normal(size=(g["n"], g["k"])).astype(np.float32)).astype(dtypes[1])
    one = jnp.float32(1)
    flops = 2 * g["m"] * g["n"] * g["k"]
    out = {}
    fast = g["role"] == "forward"
    for key, precision in (("tflops", None if fast else jax.lax.Precision.HIGHEST),
                           ("tflops_other_accumulation",
                            jax.lax.Precision.HIGHEST if fast else None)):
        gemm = jax.jit(functools.partial(_gemms.gemm, dimension_numbers=(((1,), (1,)), ((), ())),
                                         scale_inv_a=one, scale_inv_b=one,
                                         out_dtype=jnp.bfloat16, precision=precision))
        jax.block_until_ready(gemm(a, b))
        _, events = trace.capture(lambda c: (c[0], c[1], gemm(c[0], c[1])),
                                  (a, b, gemm(a, b)), steps=steps)
        kernels = [e for e in trace.device_events(events, platform="gpu")
                   if _GEMM_NAME.search(str(e.get("name", "")))]
        us = sum(float(e.get("dur", 0.0)) for e in kernels)
        out[key] = flops * steps / (us * 1e-6) / 1e12 if us else None
    return out


def analyze(mod):
    """(HLO summary for the row, `hlo_families`, `hlo.kernel_bytes`, `gemm_info`) of the
    compiled step (a parsed module)."""
    gemms = hlo.gemms(mod)
    calls = hlo.custom_calls(mod)
    summary = {
        "kernels": len(hlo.kernel_instructions(mod)), "gemms_fp8": sum(g.fp8 for g in gemms),
        "gemms_other": sum(not g.fp8 for g in gemms),
        "fp8_gemms": dict(sorted(collections.Counter(g.kind for g in gemms if g.fp8).items())),
        "custom_calls": calls,
        "attention_calls": sum(n for t, n in calls.items() if _ATTENTION_NAME.search(t)),
        "jax_fp8_update": calls.get("jax_fp8_update", 0)}
    return summary, hlo_families(mod, gemms), hlo.kernel_bytes(mod), gemm_info(mod, gemms)


def measure(variant, size, args, progress=log):
    """Measures ``variant`` at ``size`` in this process; returns its result row."""
    tag = f"{size.name} {variant.name}"
    platform = common.platform_name()
    row = {"size": size.name, "variant": variant.name, "label": variant.label,
           "kind": variant.kind, "platform": platform,
           "environment": common.environment(__file__, sys.argv[1:]),
           "config": dataclasses.asdict(size), "tokens": size.tokens,
           "params": size.params(), "model_tflop_per_step": size.flops_per_step() / 1e12,
           "attention_impl": attention_impl(args), "scan": args.scan,
           "fp8_lm_head": args.fp8_lm_head, "rope": not args.no_rope}
    rng = np.random.default_rng(args.seed)
    seqs = rng.integers(0, size.vocab, (size.batch, size.seq + 1), dtype=np.int32)
    tokens, labels = jnp.asarray(seqs[:, :-1]), jnp.asarray(seqs[:, 1:])

    errors = []
    t0 = time.perf_counter()
    state = jax.block_until_ready(make_state(variant, size, args, tokens))
    row["init_s"] = time.perf_counter() - t0
    row["state_arrays"] = len(jax.tree.leaves(state))
    progress(f"{tag}: state ready in {row['init_s']:.1f} s; lowering and compiling")

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        t0 = time.perf_counter()
        lowered = jax.jit(step_function(variant), donate_argnums=(0,)).lower(state, tokens,
                                                                             labels)
        row["lower_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = time.perf_counter() - t0
    row["lower_compile_s"] = row["lower_s"] + row["compile_s"]
    row["memory"] = compilation.memory(compiled)
    row["temp_bytes"] = row["memory"].get("temp_size_in_bytes")
    t0 = time.perf_counter()
    mod = hlo.parse(compiled.as_text())
    row["hlo"], families, kernel_bytes, gemms = analyze(mod)
    del mod, lowered
    row["analysis_s"] = time.perf_counter() - t0
    progress(f"{tag}: lowered in {row['lower_s']:.1f} s, compiled in {row['compile_s']:.1f} s, "
             f"temp {row['temp_bytes'] or 0:,} bytes; {row['hlo']['gemms_fp8']} FP8 GEMMs, "
             f"{row['hlo']['gemms_other']} other GEMMs")
    if variant.update_calls is not None and row["hlo"]["jax_fp8_update"] != variant.update_calls:
        errors.append(f"expected {variant.update_calls} jax_fp8_update custom call(s), found "
                      f"{row['hlo']['jax_fp8_update']} (kernels loaded: CPU "
                      f"{jax_fp8.HAS_CPU_KERNEL}, CUDA {jax_fp8.HAS_CUDA_KERNEL})")

    def step(s):
        return compiled(s, tokens, labels)

    t0 = time.perf_counter()
    state, times, losses = common.time_steps(step, state, args)
    row.update(times)
    row["steps_s"] = time.perf_counter() - t0
    row["tokens_per_s"] = size.tokens / (row["pipelined_ms"] / 1e3)
    progress(f"{tag}: pipelined {row['pipelined_ms']:.2f} ms, blocked "
             f"{row['blocked_ms']:.2f} ms per step; tracing {args.steps} steps")

    t0 = time.perf_counter()
    state, events = trace.capture(lambda s: step(s)[0], state, steps=args.steps)
    if platform == "gpu":
        dev = trace.device_events(events, platform="gpu")
        if dev:
            row["device_ms"] = trace.total_us(dev) / args.steps / 1e3
            row["events_per_step"] = len(dev) / args.steps
            (row["families_ms"], row["classified_by"], row["top_kernels"],
             row["families_bandwidth"]) = split_by_family(dev, families, args.steps,
                                                          args.top_kernels, kernel_bytes)
            row["gemms"] = gemm_table(dev, gemms, args.steps)
            if args.gemms_alone:
                for g in row["gemms"]["rows"]:
                    if g["fp8"]:
                        g["alone"] = time_fp8_gemm_alone(g, args.steps)
            row["tokens_per_s_device"] = size.tokens / (row["device_ms"] / 1e3)
            row["model_tflops_device"] = size.flops_per_step() / (row["device_ms"] / 1e3) / 1e12
        else:
            row["device_time_note"] = "no GPU kernel events in the profiler trace"
    else:
        row["device_time_note"] = (f"device time unavailable on {platform}: the trace has no "
                                   "GPU kernels")
        ops = trace.device_events(events, platform="cpu")
        if ops:
            row["cpu_op_families_ms"], _, row["top_ops"], _ = split_by_family(
                ops, families, args.steps, args.top_kernels)
            row["cpu_gemms"] = gemm_table(ops, gemms, args.steps)
    del events
    row["trace_s"] = time.perf_counter() - t0
    row["device_ms"] = row.get("device_ms")
    row["loss_first"], row["loss_last"] = losses[0], losses[-1]
    row["loss_finite"] = all(math.isfinite(v) for v in losses)
    if not row["loss_finite"]:
        errors.append(f"a non-finite loss: {losses}")
    if errors:
        row["check_error"] = "; ".join(errors)
    return row


def worker(args):
    """--worker: one size and variant, the row written to --result as JSON."""
    (size_name,), (name,) = args.sizes, args.variants
    for piece in VARIANTS[name].xla_pieces:
        hand_to_xla(piece)
    common.write_json(args.result, measure(VARIANTS[name], SIZES[size_name], args))
    return 0


# --------------------------------------------------------------------------------------
# The plan: one worker process per size and variant.
# --------------------------------------------------------------------------------------

WORKER_OPTIONS = ("steps", "warmup", "history_len", "lr", "seed", "top_kernels", "attention")
WORKER_FLAGS = ("scan", "fp8_lm_head", "no_rope", "gemms_alone")


def worker_env():
    """This process's environment without JAX's persistent compilation cache or XLA's
    autotune caches: every worker compiles cold."""
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", PYTHONUNBUFFERED="1")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cached = re.compile(r"--xla_gpu_(per_fusion_autotune_cache_dir|load_autotune_results_from)")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not cached.match(f))
    return env


def run_worker(size, variant, args, timeout):
    """Runs one worker process; returns (row, check errors). Its output is passed on to
    stderr, indented, as it comes."""
    with tempfile.TemporaryDirectory(prefix="bench_llm_") as tmp:
        result = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--result", result,
               "--sizes", size.name, "--variants", variant.name]
        for opt in WORKER_OPTIONS:
            cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
        cmd += [f"--{f.replace('_', '-')}" for f in WORKER_FLAGS if getattr(args, f)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        tail = collections.deque(maxlen=40)

        def forward():
            for line in proc.stdout:
                tail.append(line.rstrip())
                print("    " + line.rstrip(), file=sys.stderr, flush=True)
        reader = threading.Thread(target=forward, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join(5)
            raise RuntimeError(f"timed out after {timeout:.0f} s (--timeout-per-variant)")
        reader.join(5)
        if rc != 0 or not os.path.exists(result):
            raise RuntimeError(f"worker exited {rc}: {_last_error(tail)}")
        with open(result) as fp:
            row = json.load(fp)
    row["process_s"] = time.perf_counter() - t0
    return row, [row["check_error"]] if row.get("check_error") else []


def _last_error(lines) -> str:
    """The last exception line of a worker's output (else its last line)."""
    lines = [ln.strip() for ln in lines if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)]
    return (errors or lines or ["no output"])[-1][:2000]


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
                 "products of [M, K] × [K, N]; TFLOP/s = 2 B M N K per call / its time; backward: under JAX's `transpose(` in the "
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
    lines = [f"# Llama-style decoder train step — {env.get('device', '?')}", "",
             f"jax {env.get('jax_version', '?')}, flax {env.get('flax_version', '?')}, "
             f"jax_fp8 {env.get('jax_fp8_version', '?')}; git {meta.get('git_commit')}; "
             f"{meta.get('date')}. Each variant in its own process; {s['warmup']} warm-up "
             f"steps, then {s['steps']} blocked, {s['steps']} pipelined and {s['steps']} "
             f"traced steps; amax history {s['history_len']}; LM head "
             f"{'FP8' if s['fp8_lm_head'] else 'bf16'}; blocks "
             f"{'scanned' if s['scan'] else 'unrolled'}.", "",
             "device: the sum of the GPU kernel durations per step (profiler trace); "
             "pipelined: wall time per step of steps dispatched back to back; blocked: median "
             "wall time of steps each followed by block_until_ready; × > 1 is faster; compile: "
             "lower + compile in a fresh process; temp: the compiled step's temporary "
             "buffers.", "", FLOOR_NOTE, "", FAMILY_NOTE]
    gib = 2.0 ** 30
    for key, per in data["derived"].items():
        rows = [r for r in data["results"] if r["size"] == key]
        c = rows[0]["config"]
        lines += ["", f"## {key}: d {c['d']}, {c['heads']} heads, ffn {c['ffn']}, "
                      f"{c['layers']} blocks, {c['batch']} × {c['seq']} tokens, "
                      f"vocab {c['vocab']}",
                  "", "| variant | device ms | × bf16 | × Flax FP8 | pipelined ms | × bf16 | "
                      "× Flax FP8 | pipelined / device | blocked ms | tokens/s | compile s | "
                      "temp GiB |", "|---|" + "---:|" * 11]
        for r in rows:
            e = per.get(r["variant"], {})
            temp = r.get("temp_bytes")
            lines.append("| " + " | ".join([
                r["label"], _f(r.get("device_ms")), _f(e.get("device_ms:vs_bf16"), "{:.3f}"),
                _f(e.get("device_ms:vs_flax"), "{:.3f}"), _f(r.get("pipelined_ms")),
                _f(e.get("pipelined_ms:vs_bf16"), "{:.3f}"),
                _f(e.get("pipelined_ms:vs_flax"), "{:.3f}"),
                _f(e.get("pipelined_over_device"), "{:.3f}"), _f(r.get("blocked_ms")),
                _f(r.get("tokens_per_s"), "{:,.0f}"), _f(r.get("lower_compile_s"), "{:.1f}"),
                _f(None if temp is None else temp / gib)]) + " |")
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


def save_plot(data, outdir):
    png = os.path.join(outdir, "plot.png")
    try:
        plot(data, png)
    except ImportError as err:
        log(f"no plot ({err}): matplotlib is missing")


# --------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------

def build_parser():
    p = common.arg_parser("A Llama-style decoder's training step: bf16, Flax FP8 and jax_fp8's "
                          "recipes side by side, one process each (bench/README.md).", __doc__)
    p.add_argument("--sizes", type=common.subset_of(SIZES, "sizes"),
                   default=list(DEFAULT_SIZES),
                   help=f"comma-separated subset of {','.join(SIZES)} (default: "
                        f"{','.join(DEFAULT_SIZES)})")
    p.add_argument("--variants", type=common.subset_of(VARIANTS, "variants"),
                   default=list(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: "
                        f"{','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--steps", type=int, default=10,
                   help="steps blocked, pipelined and traced, each (10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (3)")
    p.add_argument("--timeout-per-variant", type=float, default=300,
                   help="seconds one worker process may take before it is stopped (300)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting workers once this much time is spent, and cut each "
                        "worker's timeout to what is left (default: no limit)")
    p.add_argument("--history-len", type=int, default=1024,
                   help="amax history length, Flax and jax_fp8 delayed alike (1024)")
    p.add_argument("--lr", type=float, default=1e-4, help="adamw learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", choices=("auto", "cudnn", "xla"), default="auto",
                   help="jax.nn.dot_product_attention's implementation (auto: cudnn on a GPU, "
                        "xla elsewhere)")
    p.add_argument("--scan", action="store_true", help="nn.scan over the blocks (not unrolled)")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="the LM head with the variant's FP8 dot_general too (default bf16)")
    p.add_argument("--no-rope", action="store_true", help="no rotary position embedding")
    p.add_argument("--gemms-alone", action="store_true",
                   help="also time each FP8 GEMM shape of the step on its own, with both "
                        "accumulations (GPU)")
    p.add_argument("--top-kernels", type=int, default=25,
                   help="kernels with the most device time kept per variant in results.json")
    p.add_argument("--outdir", default=os.path.join("out", "bench_llm"),
                   help="results.json, results.md, plot.png (default out/bench_llm)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def _summary(r):
    parts = [f"process {r['process_s']:.0f} s (init {r['init_s']:.1f}, lower + compile "
             f"{r['lower_compile_s']:.1f}, HLO analysis {r['analysis_s']:.1f}, steps "
             f"{r['steps_s']:.1f}, trace {r['trace_s']:.1f})"]
    parts += common.times_text(r, TIMES)
    if r.get("device_ms") is None:
        parts.append("device time unavailable")
    return parts


def run(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.worker:
        return worker(args)
    # This process starts no jax backend (on a GPU it would hold memory the workers need).
    os.makedirs(args.outdir, exist_ok=True)
    plan = [(SIZES[s], VARIANTS[v]) for s in args.sizes for v in args.variants]
    t_all = time.perf_counter()
    meta = {**common.run_info(__file__, argv),
            "settings": {"sizes": args.sizes, "variants": args.variants, "steps": args.steps,
                         "warmup": args.warmup, "history_len": args.history_len, "lr": args.lr,
                         "seed": args.seed, "attention": args.attention, "scan": args.scan,
                         "fp8_lm_head": args.fp8_lm_head, "rope": not args.no_rope,
                         "timeout_per_variant": args.timeout_per_variant,
                         "budget": args.budget},
            "floor_definition": FLOOR_NOTE, "family_definition": FAMILY_NOTE,
            "families": list(FAMILIES)}
    runs = common.Runs(meta, args.outdir, derive, markdown, t_all)
    with common.Progress(len(plan), "bench_llm") as progress:
        progress.log(f"bench_llm: sizes {args.sizes}, variants {args.variants}, "
                     f"{args.steps} steps; one process each")
        for size, v in plan:
            timeout = args.timeout_per_variant
            if args.budget is not None:
                timeout = min(timeout, args.budget - (time.perf_counter() - t_all))
            where = {"size": size.name, "variant": v.name}
            if timeout < 15:
                runs.skipped.append({**where, "reason": "--budget spent"})
                progress.advance(f"{size.name} {v.name}: skipped, --budget spent")
                continue
            progress.status(f"{size.name} {v.name}")
            progress.log(f"{size.name} {v.name}: starting a worker (timeout {timeout:.0f} s)")

            def measure_one(size=size, v=v, timeout=timeout):
                row, errors = run_worker(size, v, args, timeout)
                if not meta.get("environment"):
                    env = row["environment"]
                    meta["environment"] = {k: env.get(k) for k in (
                        "device", "platform", "device_count", "jax_version", "jaxlib_version",
                        "jax_fp8_version", "has_cpu_kernel", "has_cuda_kernel", "xla_flags")}
                    meta["environment"].update(flax_version=flax.__version__,
                                               optax_version=optax.__version__)
                return row, errors
            runs.measure(where, measure_one, _summary, progress)
            save_plot(runs.data(partial=True), args.outdir)
    data = runs.finish()
    save_plot(data, args.outdir)
    common.print_report(data, args.outdir)
    return data


def main(argv=None):
    data = run(argv)
    return data if isinstance(data, int) else (1 if data["failures"] else 0)


if __name__ == "__main__":
    sys.exit(main())
