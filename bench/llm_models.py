"""The benchmark's decoders, their sizes, the variants that run them and their train steps."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import fp8_ops
from flax.training import train_state

import common
import jax_fp8
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8Rule, Fp8TrainState, fp8_model

# --------------------------------------------------------------------------------------
# Sizes.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Size:
    """A decoder's architecture, shape and batch: ``arch`` (`ARCHS`), width ``d``, ``heads``
    query heads of ``head_size`` (None: d / heads) with ``kv_heads`` key/value heads (None:
    heads), gated-MLP width ``ffn``, ``layers`` blocks, ``batch`` x ``seq`` tokens,
    ``vocab``; ``window``: the sliding window of the local layers, every
    ``global_every``-th layer attending globally (None: every layer global)."""

    name: str
    d: int
    heads: int
    ffn: int
    layers: int
    batch: int
    seq: int
    vocab: int = 32000
    arch: str = "llama"
    kv_heads: int | None = None
    head_size: int | None = None
    window: int | None = None
    global_every: int = 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d // self.heads

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def is_global(self, layer: int) -> bool:
        return self.window is None or (layer + 1) % self.global_every == 0

    def matmul_params(self) -> int:
        """Parameters of the GEMMs: the attention and MLP projections of every block and
        the LM head (tied to the embedding in gemma3, a GEMM all the same)."""
        attn = self.d * self.head_dim * (2 * self.heads + 2 * self.kv)
        return self.layers * (attn + 3 * self.d * self.ffn) + self.d * self.vocab

    def params(self) -> int:
        """All parameters: the GEMMs', the embedding (unless tied) and the norms' scales."""
        norms = {"llama": 2 * self.layers * self.d,
                 "qwen3": self.layers * (2 * self.d + 2 * self.head_dim),
                 "gemma3": self.layers * (4 * self.d + 2 * self.head_dim)}[self.arch]
        embed = 0 if self.arch == "gemma3" else self.vocab * self.d
        return self.matmul_params() + embed + norms + self.d

    def flops_per_step(self) -> float:
        """Model FLOPs of one training step: 6 per GEMM parameter and token, plus the
        attention products (QK^T and PV, forward and backward) over the keys each query
        sees: half the sequence on average for a causal global layer, the window (at most)
        for a local one."""
        width = self.heads * self.head_dim
        keys = sum(self.seq / 2 if self.is_global(i) else min(self.window, self.seq / 2)
                   for i in range(self.layers))
        return self.tokens * (6.0 * self.matmul_params() + 12.0 * width * keys)


SIZES = {s.name: s for s in (
    Size("tiny", 128, 2, 256, 2, 2, 64, vocab=512),
    Size("350m", 1024, 16, 2816, 24, 8, 2048),
    Size("1b", 2048, 16, 5632, 16, 4, 2048),
    Size("8b_slice", 4096, 32, 14336, 4, 2, 4096),
    # Gemma 3 1B as Flax's Gemma example configures it (its lm1b vocabulary).
    Size("gemma3_tiny", 128, 2, 256, 2, 2, 64, vocab=512, arch="gemma3", kv_heads=1,
         head_size=64, window=16, global_every=2),
    Size("gemma3_1b", 1152, 4, 6912, 26, 4, 2048, vocab=35008, arch="gemma3", kv_heads=1,
         head_size=256, window=512, global_every=6),
    # Qwen3 1.7B: grouped-query attention with QK-norm, an untied 152k-token LM head.
    Size("qwen3_tiny", 128, 4, 256, 2, 2, 64, vocab=512, arch="qwen3", kv_heads=2,
         head_size=32),
    Size("qwen3_1.7b", 2048, 16, 6144, 28, 4, 2048, vocab=151936, arch="qwen3", kv_heads=8,
         head_size=128),
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


def apply_rope(x, positions, base=10000.0):
    """Rotary position embedding of ``x`` [batch, seq, heads, head_dim] (halves rotated)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
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


# Architectures users bring, written as their authors write them (head-split projection
# weights, no FP8 in the model): jax_fp8's variants convert them with `fp8_model`.

einsum = functools.partial(nn.Einsum, use_bias=False, dtype=jnp.bfloat16,
                           param_dtype=jnp.float32)


def _attention(q, k, v, *, local_window, implementation):
    """Causal attention of q [b, t, heads, h] over k, v [b, t, kv_heads, h] (grouped
    queries), within ``local_window`` keys when given."""
    window = None if local_window is None else (local_window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                        implementation=implementation)


class Gemma3Block(nn.Module):
    """Gemma 3's block as Flax's Gemma example builds it: pre- and post-norms around
    attention and the MLP, QK-norm, one key/value head, a sliding window on local layers
    (RoPE base 10k; 1M on global ones), query scaled by head_dim^-1/2, GeGLU MLP.
    ``x`` [batch, seq, d]."""

    size: Size
    local: bool
    attention: str | None = None

    @nn.compact
    def __call__(self, x):
        s = self.size
        h = RMSNorm(name="pre_attention_norm")(x)
        q = einsum((s.heads, s.d, s.head_dim), "BTD,NDH->BTNH", name="q_einsum")(h)
        kv = einsum((2, s.kv, s.d, s.head_dim), "BSD,CKDH->CBSKH", name="kv_einsum")(h)
        k, v = kv[0], kv[1]
        q, k = RMSNorm(name="query_norm")(q), RMSNorm(name="key_norm")(k)
        pos = jnp.arange(s.seq)
        base = 10_000.0 if self.local else 1_000_000.0
        q = apply_rope(q, pos, base) * jnp.bfloat16(s.head_dim ** -0.5)
        k = apply_rope(k, pos, base)
        att = _attention(q, k, v, local_window=s.window if self.local else None,
                         implementation=self.attention)
        att = einsum((s.heads, s.head_dim, s.d), "BTNH,NHD->BTD", name="attn_vec_einsum")(att)
        x = x + RMSNorm(name="post_attention_norm")(att)
        h = RMSNorm(name="pre_ffw_norm")(x)
        gate_up = einsum((2, s.d, s.ffn), "BTD,CDF->CBTF", name="gating_einsum")(h)
        h = GatedDown(s.d, nn.gelu, as_einsum=True, name="mlp_out")(gate_up[0], gate_up[1])
        return x + RMSNorm(name="post_ffw_norm")(h)


class GatedDown(nn.Module):
    """activation(gate) * up, then the down projection ``proj`` (an ``nn.Einsum`` where the
    architecture writes it so, else a Dense): the pair a fused activation+quantize kernel
    replaces, in the module scope the kernel-family rules read ("mlp_out")."""

    features: int
    activation: Callable
    as_einsum: bool = False

    @nn.compact
    def __call__(self, gate, up):
        h = self.activation(gate) * up
        if self.as_einsum:
            return einsum((h.shape[-1], self.features), "BTF,FD->BTD", name="proj")(h)
        return dense(self.features, name="proj")(h)


class Gemma3(nn.Module):
    """Tokens [batch, seq] -> logits [batch * seq, vocab] (bf16): embedding scaled by
    sqrt(d), `Gemma3Block`s (every ``global_every``-th global), final norm, the embedding
    as the LM head (tied: ``nn.Embed.attend``)."""

    size: Size
    attention: str | None = None

    @nn.compact
    def __call__(self, tokens):
        s = self.size
        embed = nn.Embed(s.vocab, s.d, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                         embedding_init=nn.initializers.normal(0.02), name="embedder")
        x = embed(tokens) * jnp.bfloat16(s.d ** 0.5)
        for i in range(s.layers):
            x = Gemma3Block(s, not s.is_global(i), self.attention, name=f"layer_{i}")(x)
        x = RMSNorm(name="final_norm")(x)
        return embed.attend(x).reshape(s.tokens, s.vocab)


class Qwen3Block(nn.Module):
    """Qwen 3's block: RMSNorm, q/k/v projections to heads (grouped-query), QK-norm, RoPE
    (base 1M), causal attention, output projection, residual; RMSNorm, SwiGLU MLP with
    separate gate and up projections, residual. ``x`` [batch, seq, d]."""

    size: Size
    attention: str | None = None

    @nn.compact
    def __call__(self, x):
        s = self.size
        proj = functools.partial(nn.DenseGeneral, use_bias=False, dtype=jnp.bfloat16,
                                 param_dtype=jnp.float32)
        h = RMSNorm(name="input_norm")(x)
        q = proj((s.heads, s.head_dim), name="q_proj")(h)
        k = proj((s.kv, s.head_dim), name="k_proj")(h)
        v = proj((s.kv, s.head_dim), name="v_proj")(h)
        q, k = RMSNorm(name="q_norm")(q), RMSNorm(name="k_norm")(k)
        pos = jnp.arange(s.seq)
        q, k = apply_rope(q, pos, 1_000_000.0), apply_rope(k, pos, 1_000_000.0)
        att = _attention(q, k, v, local_window=None, implementation=self.attention)
        x = x + proj(s.d, axis=(-2, -1), name="o_proj")(att)
        h = RMSNorm(name="post_attention_norm")(x)
        gate, up = dense(s.ffn, name="gate_proj")(h), dense(s.ffn, name="up_proj")(h)
        return x + GatedDown(s.d, nn.silu, name="mlp_out")(gate, up)


class Qwen3(nn.Module):
    """Tokens [batch, seq] -> logits [batch * seq, vocab] (bf16): embedding, `Qwen3Block`s,
    final norm, an untied LM head."""

    size: Size
    attention: str | None = None

    @nn.compact
    def __call__(self, tokens):
        s = self.size
        x = nn.Embed(s.vocab, s.d, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                     embedding_init=nn.initializers.normal(0.02), name="embed")(tokens)
        for i in range(s.layers):
            x = Qwen3Block(s, self.attention, name=f"layer_{i}")(x)
        x = RMSNorm(name="final_norm")(x).reshape(s.tokens, s.d)
        return dense(s.vocab, name="lm_head")(x)


ARCHS = {"llama": Decoder, "gemma3": Gemma3, "qwen3": Qwen3}


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

    def resolved(self) -> Layers:
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
# (tests/kernels/test_layout_kernels.py). The whole step may still differ in its last bits: XLA
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
    "kernel_rotation": ("jax_fp8.gemm._gemms", "rhs_for_forward",
                        lambda q_rhs, dimension_numbers: (q_rhs, dimension_numbers)),
    # Neither layout kernel takes any size: every FP8 transpose, and the gradient's
    # quantize + transpose + amax, lower to XLA's own ops.
    "layout_kernels": ("jax_fp8._primitives.layout", "kernel_supports", lambda rows, cols: False),
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
    """The variant's model at ``size``: for the Llama-style decoder the variant's layers
    written into it; any other architecture as its authors write it, converted by
    ``jax_fp8.flax.fp8_model`` with the variant's recipe (jax_fp8 variants)."""
    layers = variant.make_layers(args)
    if size.arch == "llama":
        return Decoder(size, layers, scan=args.scan, rope=not args.no_rope)
    if args.scan or args.fp8_lm_head or args.no_rope or variant.kind == "flax":
        raise ValueError(f"{size.arch}: --scan, --fp8-lm-head, --no-rope and Flax FP8 apply "
                         "to the Llama-style decoder only")
    model = ARCHS[size.arch](size, layers.attention)
    if variant.kind == "jax_fp8":
        rules = [Fp8Rule(recipe=variant.recipe(args), min_fp8_flops=args.min_fp8_flops)]
        if args.keep_bf16:
            rules.insert(0, Fp8Rule(path=args.keep_bf16, recipe=None))
        model = fp8_model(model, rules)
    return model


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
