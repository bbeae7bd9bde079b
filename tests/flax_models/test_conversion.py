"""`fp8_model`: a Flax model made FP8 in one call equals the model written with jax_fp8's
FP8 layers, bit for bit (variables, forward, train steps), in linen and NNX, under
nn.scan / nn.remat / nn.vmap and nnx.scan / nnx.vmap, on classes imported from Flax."""

from __future__ import annotations

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
from helpers import assert_trees_equal, train_steps
from jax_fp8.devtools import hlo
from jax_fp8.flax import (
    FP8_COLLECTION,
    Fp8DotGeneral,
    Fp8Einsum,
    Fp8Rule,
    Fp8TrainState,
    fp8_model,
    nnx as fnnx,
    rules as rules_lib,
)

KEY = jax.random.key(0)
RECIPE = jax_fp8.DelayedScaling(history_len=4)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
RULE = Fp8Rule(recipe=RECIPE, min_fp8_flops=0)


def _n_states(tree):
    return sum(isinstance(s, jax_fp8.ScalingState) for s in jax.tree.leaves(
        tree, is_leaf=lambda s: isinstance(s, jax_fp8.ScalingState)))


# ----------------------------------------------------------------------------- rules

def test_rule_checks_its_fields():
    with pytest.raises(ValueError, match="Fp8Rule.path"):
        Fp8Rule(path="(")
    with pytest.raises(TypeError, match="Fp8Rule.path"):
        Fp8Rule(path=3)
    with pytest.raises(TypeError, match="Fp8Rule.recipe"):
        Fp8Rule(recipe="delayed")
    with pytest.raises(ValueError, match="Fp8Rule.min_fp8_flops"):
        Fp8Rule(min_fp8_flops=-1)
    with pytest.raises(TypeError, match="Fp8Rule.activations"):
        Fp8Rule(activations=1)
    with pytest.raises(TypeError, match=r"rules\[1\]"):
        rules_lib.as_rules([Fp8Rule(), "Dense_0"])
    with pytest.raises(TypeError, match="rules must be an Fp8Rule"):
        rules_lib.as_rules("Dense_0")
    assert rules_lib.as_rules(None) == (Fp8Rule(),)


def test_first_matching_rule_decides():
    rules = rules_lib.as_rules([Fp8Rule(path=".*head", recipe=None),
                                 Fp8Rule(path="blocks/.*", recipe=jax_fp8.Float8BlockScaling()),
                                 Fp8Rule()])
    assert rules_lib.rule_for(rules, "blocks/0/head") is None          # excluded
    assert rules_lib.rule_for(rules, "blocks/0/up") is rules[1]
    assert rules_lib.rule_for(rules, "embed") is rules[2]
    assert rules_lib.rule_for(rules[1:2], "embed") is None             # no rule: as is
    assert not Fp8Rule(path="Dense_1").matches("Dense_10")              # a full match


@pytest.mark.parametrize("spec, shapes, expected", [
    ("bd,dh->bh", ((2, 3), (3, 4)), "bd,dh->bh"),
    ("bd,dh", ((2, 3), (3, 4)), "bd,dh->bh"),                       # implicit output
    ("...d,dh->...h", ((2, 5, 3), (3, 4)), "abd,dh->abh"),
    ("...qhd,...khd->...hqk", ((2, 5, 2, 3), (2, 6, 2, 3)), "aqhd,akhd->ahqk"),
    ("...qhd,...khd->...hqk", ((1, 5, 2, 3), (2, 6, 2, 3)), None),  # the ellipsis broadcasts
    ("ii,ij->j", ((2, 2), (2, 3)), None),                           # a diagonal
    ("ab,bc,cd->ad", ((2, 2), (2, 2)), None),
])
def test_explicit_einsum(spec, shapes, expected):
    assert rules_lib.explicit_einsum(spec, *shapes) == expected


# ------------------------------------------------------------------- linen models

class Raw(nn.Module):
    """GEMMs of every kind the converter sees, in a module of its own."""

    d: int = 8

    @nn.compact
    def __call__(self, x):
        d = self.d
        x = nn.Dense(2 * d)(x)
        w1 = self.param("w1", nn.initializers.lecun_normal(), (2 * d, d))
        x = jnp.einsum("bd,dh->bh", nn.relu(x), w1)                 # kernel on the rhs
        w2 = self.param("w2", nn.initializers.lecun_normal(), (d, d))
        x = jax.lax.dot_general(w2, x, (((0,), (1,)), ((), ()))).T  # kernel on the lhs
        x = nn.DenseGeneral((2, d // 2))(x).reshape(x.shape[0], d)
        return nn.Einsum((d, d), "bd,dh->bh")(x)


class _EinsumFp8(nn.Einsum):
    """nn.Einsum written with Fp8Einsum (what the converter must reproduce)."""

    @nn.compact
    def __call__(self, inputs, einsum_str=None):
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        bias = self.param("bias", self.bias_init, self.shape[-1:], self.param_dtype)
        return Fp8Einsum(recipe=RECIPE)(self.einsum_str, inputs, kernel) + bias


_EinsumFp8.__name__ = "Einsum"  # auto-named Einsum_0, as the layer it stands for


class RawByHand(nn.Module):
    d: int = 8

    @nn.compact
    def __call__(self, x):
        d = self.d
        x = nn.Dense(2 * d, dot_general_cls=DG)(x)
        w1 = self.param("w1", nn.initializers.lecun_normal(), (2 * d, d))
        # A module's own GEMM has the FP8 state of the weight it multiplies: <weight>_fp8.
        x = Fp8Einsum(recipe=RECIPE, name="w1_fp8")("bd,dh->bh", nn.relu(x), w1)
        w2 = self.param("w2", nn.initializers.lecun_normal(), (d, d))
        x = DG(name="w2_fp8")(x, w2, (((1,), (0,)), ((), ())))
        x = nn.DenseGeneral((2, d // 2), dot_general_cls=DG)(x).reshape(x.shape[0], d)
        return _EinsumFp8((d, d), "bd,dh->bh")(x)


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _train(model, variables, x, y, steps=3, **apply_kwargs):
    """Losses and final state of `steps` Fp8TrainState steps (adam) from `variables`."""
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables,
                                 tx=optax.adam(1e-2), recipe=RECIPE)
    losses, state = train_steps(state, x, y, steps, loss=_xent, **apply_kwargs)
    return np.asarray(jnp.stack(losses)), state


def _data(shape=(8, 8), classes=4):
    x = jax.random.normal(jax.random.key(1), shape)
    y = jax.random.randint(jax.random.key(2), shape[:1], 0, classes)
    return x, y


def _check_same_as_by_hand(converted, by_hand, x, y, n_states, **kwargs):
    v, vh = jax.jit(converted.init)(KEY, x), jax.jit(by_hand.init)(KEY, x)
    assert_trees_equal(v, vh)
    assert _n_states(v[FP8_COLLECTION]) == n_states
    np.testing.assert_array_equal(converted.apply(v, x, **kwargs), by_hand.apply(vh, x, **kwargs))
    losses, state = _train(converted, v, x, y, **kwargs)      # from the variables compared above
    losses_h, state_h = _train(by_hand, vh, x, y, **kwargs)
    np.testing.assert_array_equal(losses, losses_h)
    assert_trees_equal(state.params, state_h.params)
    assert_trees_equal(state.fp8, state_h.fp8)
    hist = jax_fp8.unpack_states(state.fp8)
    assert any(np.any(s.amax_history != 0) for s in jax.tree.leaves(
        hist, is_leaf=lambda s: isinstance(s, jax_fp8.ScalingState)))
    return v


def test_linen_every_kind_of_gemm_equals_the_hand_written_model():
    x, y = _data()
    v = _check_same_as_by_hand(fp8_model(Raw(), RULE), RawByHand(), x, y, n_states=5 * 3)
    # The params are those of the unconverted model: same paths, same initial values.
    assert_trees_equal(v["params"], jax.jit(Raw().init)(KEY, x)["params"])


def test_linen_eager_evaluation_twice():
    """Applying an FP8 model eagerly with its collection immutable, twice, returns."""
    model = nn.Dense(4, dot_general_cls=DG)
    x = jnp.ones((2, 8))
    v = model.init(KEY, x)
    np.testing.assert_array_equal(model.apply(v, x), model.apply(v, x))


def test_linen_a_hand_written_fp8_model_converts_to_itself():
    x, _ = _data()
    v, v2 = (jax.jit(m.init)(KEY, x) for m in (RawByHand(), fp8_model(RawByHand(), RULE)))
    assert_trees_equal(v, v2)
    np.testing.assert_array_equal(jax.jit(RawByHand().apply)(v, x),
                                  jax.jit(fp8_model(RawByHand(), RULE).apply)(v, x))


def test_linen_params_of_the_original_model_load_into_the_converted_one():
    x, _ = _data()
    params = jax.jit(Raw().init)(KEY, x)["params"]
    converted = fp8_model(Raw(), RULE)
    # The FP8 states of existing params: apply with the FP8 collection mutable.
    _, fp8 = converted.apply({"params": params}, x, mutable=[FP8_COLLECTION])
    out = converted.apply({"params": params, **fp8}, x)
    np.testing.assert_array_equal(
        out, RawByHand().apply({"params": params, **fp8}, x))


def test_linen_attention_projections_convert_and_scores_do_not():
    # A class imported from Flax: its projections take dot_general_cls by hand.
    kwargs = dict(num_heads=2, qkv_features=16, out_features=4, deterministic=True)
    mha = nn.MultiHeadDotProductAttention(**kwargs)
    by_hand = nn.MultiHeadDotProductAttention(**kwargs, qkv_dot_general_cls=DG,
                                              out_dot_general_cls=DG)

    class Pool(nn.Module):   # attention over a (batch, 4, 8) input, logits per example
        attention: nn.Module

        @nn.compact
        def __call__(self, x):
            return self.attention(x.reshape(x.shape[0], 4, 2)).mean(axis=1)

    x, y = _data((4, 8))
    _check_same_as_by_hand(fp8_model(Pool(mha), RULE), Pool(by_hand), x, y, n_states=4 * 3)
    # activations=True: q @ k and p @ v in FP8 too (two more FP8 GEMMs of two activations).
    rule = Fp8Rule(recipe=RECIPE, activations=True, min_fp8_flops=0)
    v = jax.jit(fp8_model(Pool(mha), rule).init)(KEY, x)
    assert _n_states(v[FP8_COLLECTION]) == 6 * 3


class Bf16(nn.Module):
    """Layers computing in bfloat16 from float32 params (their kernels cast on the way)."""

    dg: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, dtype=jnp.bfloat16, dot_general_cls=self.dg)(x)
        return nn.DenseGeneral(4, dtype=jnp.bfloat16, dot_general_cls=self.dg)(h)


def test_linen_bfloat16_layers_equal_the_hand_written_model():
    x, y = _data()
    _check_same_as_by_hand(fp8_model(Bf16(), RULE), Bf16(DG), x, y, n_states=2 * 3)


class Block(nn.Module):
    """A block of Flax layers (the class a scan / remat / vmap lifts)."""

    dg: object = None

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.Dense(8, dot_general_cls=self.dg)(x)
        return x + nn.DenseGeneral(8, dot_general_cls=self.dg)(nn.gelu(h)), None


class Stack(nn.Module):
    kind: str
    dg: object = None

    @nn.compact
    def __call__(self, x):
        axes = {"params": 0, FP8_COLLECTION: 0}
        if self.kind == "scan":
            layers = nn.scan(Block, variable_axes=axes, split_rngs={"params": True},
                             length=3)(self.dg, name="layers")
            x = layers(x, None)[0]
        elif self.kind == "remat":
            for _ in range(2):
                x = nn.remat(Block)(self.dg)(x)[0]
        else:  # vmap over a leading ensemble axis of 2
            ens = nn.vmap(Block, variable_axes=axes, split_rngs={"params": True},
                          in_axes=0, out_axes=0, axis_size=2)(self.dg, name="ensemble")
            x = ens(jnp.stack([x, 2 * x]))[0].mean(axis=0)
        return nn.Dense(4, dot_general_cls=self.dg)(x)


@pytest.mark.parametrize("kind, n_states", [("scan", 3 * 3), ("remat", 5 * 3),
                                            ("vmap", 3 * 3)])
def test_linen_under_scan_remat_vmap_equals_the_hand_written_model(kind, n_states):
    x, y = _data()
    v = _check_same_as_by_hand(fp8_model(Stack(kind), RULE), Stack(kind, DG), x, y, n_states)
    if kind != "remat":  # one state per layer / ensemble member, stacked as the params
        lead = 3 if kind == "scan" else 2
        assert {s.amax_history.shape for s in jax.tree.leaves(
            v[FP8_COLLECTION], is_leaf=lambda s: isinstance(s, jax_fp8.ScalingState))} \
            >= {(lead, RECIPE.history_len)}


class ScanOf(nn.Module):
    """nn.scan of Block with the model's own variable_axes."""

    axes: tuple

    @nn.compact
    def __call__(self, x):
        return nn.scan(Block, variable_axes=dict(self.axes), split_rngs={"params": True},
                       length=2)(name="layers")(x, None)[0]


def test_linen_scan_needs_the_fp8_collection():
    x, _ = _data()
    # A model whose scan lists every collection needs no change ...
    v = jax.jit(fp8_model(ScanOf(((True, 0),)), RULE).init)(KEY, x)
    assert _n_states(v[FP8_COLLECTION]) == 2 * 3
    # ... one that lists only its params says which line to change.
    with pytest.raises(ValueError, match="variable_axes"):
        fp8_model(ScanOf((("params", 0),)), RULE).init(KEY, x)


def test_linen_rules_select_layers_and_recipes():
    x, _ = _data()
    rules = [Fp8Rule(path="Dense_0", recipe=None),                  # stays as it is
             Fp8Rule(path="Einsum_0", recipe=jax_fp8.Float8CurrentScaling(), min_fp8_flops=0),
             Fp8Rule(path="DenseGeneral_0", recipe=RECIPE, min_fp8_flops=1e12),
             Fp8Rule(path="", recipe=RECIPE, min_fp8_flops=0)]             # the root: w1, w2
    v = jax.jit(fp8_model(Raw(), rules).init)(KEY, x)
    assert set(v[FP8_COLLECTION]) == {"DenseGeneral_0", "w1_fp8", "w2_fp8"}
    # Unmatched: a model whose rules match nothing is the original model.
    none = fp8_model(Raw(), Fp8Rule(path="nothing"))
    vn = jax.jit(none.init)(KEY, x)
    assert FP8_COLLECTION not in vn
    np.testing.assert_array_equal(none.apply(vn, x), Raw().apply(vn, x))


_FP8 = {np.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2)}


def _jaxpr_fp8_dots(jaxpr) -> int:
    """dot_generals of two FP8 operands in a (closed) jaxpr, sub-jaxprs included; of a
    cond's branches (the CUDA and the default lowering of one product), the largest."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and all(
                np.dtype(v.aval.dtype) in _FP8 for v in eqn.invars):
            n += 1
        for name, value in eqn.params.items():
            subs = [v for v in (value if isinstance(value, (tuple, list)) else (value,))
                    if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")]
            if subs:
                counts = [_jaxpr_fp8_dots(v) for v in subs]
                n += max(counts) if name == "branches" else sum(counts)
    return n


def _fp8_dots(fn, *args):
    """FP8 GEMMs of the program ``fn(*args)`` traces (XLA:CPU widens FP8 operands before
    its dots, so its compiled HLO has none; on a GPU they are cuBLASLt FP8 GEMMs)."""
    return _jaxpr_fp8_dots(jax.make_jaxpr(fn)(*args))


def _linen_step(model, x, y):
    state = Fp8TrainState.create(apply_fn=model.apply, tx=optax.sgd(0.1), recipe=RECIPE,
                                 variables=jax.jit(model.init)(KEY, x))

    def step(state):
        def loss_fn(params, fp8):
            return _xent(state.apply_model(params, fp8, x), y)
        _, grads = state.value_and_grad(loss_fn)()
        return state.apply_gradients(grads=grads)
    return step, state


def test_linen_train_step_has_fp8_gemms_and_one_update():
    # GEMM sizes that are multiples of 16: the sizes an FP8 GEMM takes (`_gemms.keep_fp8`).
    x, y = _data((16, 16), classes=16)
    assert _fp8_dots(*_linen_step(Raw(16), x, y)) == 0
    step, state = _linen_step(fp8_model(Raw(16), RULE), x, y)
    # 5 GEMMs, each an FP8 forward and two FP8 backward GEMMs (w2's too, on the lhs).
    assert _fp8_dots(step, state) == 5 * 3
    if jax_fp8.HAS_CPU_KERNEL:
        compiled = jax.jit(step).lower(state).compile()
        assert hlo.count_custom_calls(compiled, "jax_fp8_update") == 1
    # Excluding the root's own GEMMs leaves the three layers'.
    rules = [Fp8Rule(path="", recipe=None), RULE]
    assert _fp8_dots(*_linen_step(fp8_model(Raw(16), rules), x, y)) == 3 * 3


@pytest.mark.gpu
def test_linen_converted_step_runs_cublaslt_fp8_gemms_on_gpu():
    cc = str(getattr(jax.devices("gpu")[0], "compute_capability", "0")).split(".") + ["0"]
    if (int(cc[0]), int(cc[1])) < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
    x, y = _data((32, 64), classes=16)
    step, state = _linen_step(fp8_model(Raw(16), RULE), x, y)
    compiled = jax.jit(step).lower(state).compile()
    assert sum(hlo.fp8_gemms(compiled).values()) >= 5 * 3 - 1, hlo.fp8_gemms(compiled)
    assert hlo.count_custom_calls(compiled, "jax_fp8_update") == 1


class TwoMethods(nn.Module):
    def setup(self):
        self.enc = nn.Dense(16)
        self.dec = nn.Dense(16)

    def encode(self, x):
        return self.enc(x)

    def __call__(self, x):
        return self.dec(self.encode(x))


def test_linen_methods():
    x, _ = _data((16, 16))
    only_call = fp8_model(TwoMethods(), RULE)
    v = jax.jit(only_call.init)(KEY, x)
    assert set(v[FP8_COLLECTION]) == {"enc", "dec"}
    # encode applied on its own: converted only when listed in methods.
    both = fp8_model(TwoMethods(), RULE, methods=("__call__", "encode"))
    assert _fp8_dots(lambda v: both.apply(v, x, method="encode"), v) == 1
    assert _fp8_dots(lambda v: only_call.apply(v, x, method="encode"), v) == 0
    with pytest.raises(AttributeError, match="no method 'decode'"):
        fp8_model(TwoMethods(), methods=("decode",))


class SetupRaw(nn.Module):
    def setup(self):
        self.w = self.param("w", nn.initializers.lecun_normal(), (8, 4))

    def __call__(self, x):          # neither setup nor compact: no place for FP8 state
        return jnp.einsum("bd,dh->bh", x, self.w)


def test_linen_errors():
    # One fp8_model for both kinds of model: an NNX module is converted in place.
    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    assert fp8_model(linear, RULE) is linear and isinstance(linear.dot_general,
                                                           fnnx.Fp8DotGeneral)
    with pytest.raises(TypeError, match="flax.linen or flax.nnx Module"):
        fp8_model(object())
    with pytest.raises(TypeError, match="example inputs are for NNX models"):
        fp8_model(Raw(), RULE, jnp.ones((2, 8)))
    with pytest.raises(TypeError, match="methods=.*is for linen models"):
        fp8_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), RULE, methods=("encode",))
    with pytest.raises(TypeError, match="methods"):
        fp8_model(Raw(), methods="__call__")
    x, _ = _data()
    with pytest.raises(TypeError, match=r"recipe=None"):
        fp8_model(SetupRaw(), RULE).init(KEY, x)
    # The way out the message names works.
    v = fp8_model(SetupRaw(), [Fp8Rule(path="", recipe=None), RULE]).init(KEY, x)
    assert FP8_COLLECTION not in v


def test_linen_conversion_leaves_jax_as_it_was():
    x, _ = _data()
    model = fp8_model(Raw(), RULE)
    v = model.init(KEY, x)
    assert jax.lax.dot_general is rules_lib.ORIGINAL["dot_general"]
    assert jnp.einsum is rules_lib.ORIGINAL["einsum"]
    with pytest.raises(flax.errors.ScopeParamShapeError):
        model.apply(v, x[:, :3])   # a failing apply restores them too
    assert jax.lax.dot_general is rules_lib.ORIGINAL["dot_general"]
    assert jnp.einsum is rules_lib.ORIGINAL["einsum"]
    # The model converted twice is converted once (its class is not stacked).
    assert type(fp8_model(model, RULE)).__mro__[1] is Raw
    assert type(model).__name__ == "Raw"


# ---------------------------------------------------------------------- NNX models

class NnxModel(nnx.Module):
    """nnx.Linear, nnx.LinearGeneral, nnx.Einsum and nnx.MultiHeadAttention (from Flax)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.general = nnx.LinearGeneral(16, (2, 4), rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                                decode=False, rngs=rngs)
        self.head = nnx.Einsum("bd,dh->bh", (8, 4), (4,), rngs=rngs)

    def __call__(self, x):
        h = self.general(nnx.relu(self.up(x))).reshape(x.shape[0], 8)
        a = self.attention(h.reshape(x.shape[0], 4, 2).repeat(4, axis=-1), deterministic=True)
        return self.head(h + a.mean(axis=1))


def _nnx_by_hand(rngs):
    """NnxModel written with jax_fp8's NNX layers: an Fp8DotGeneral per layer (one each for
    the attention's projections), an Fp8Einsum for the head."""
    model = NnxModel(rngs)
    att = model.attention
    for layer in (model.up, model.general, att.query, att.key, att.value, att.out):
        layer.dot_general = nnx.data(fnnx.Fp8DotGeneral(RECIPE))
    # nnx.Einsum hands its einsum_op an out_sharding, which Fp8Einsum accepts.
    model.head.einsum_op = nnx.data(fnnx.Fp8Einsum(RECIPE))
    return model


def _nnx_train(model, x, y, steps=3):
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = fnnx.fp8_value_and_grad(lambda m: _xent(m(x), y))(model)
        fnnx.apply_gradients(model, opt, grads, RECIPE)
        return loss

    return np.array([step(model, opt) for _ in range(steps)])


def test_nnx_layers_equal_the_hand_written_model():
    x, y = _data()
    model = fp8_model(NnxModel(nnx.Rngs(0)), RULE)
    by_hand = _nnx_by_hand(nnx.Rngs(0))
    assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(by_hand, nnx.Param))
    assert_trees_equal(fnnx.fp8_state(model), fnnx.fp8_state(by_hand))
    assert _n_states(fnnx.fp8_state(model)) == 7 * 3
    np.testing.assert_array_equal(model(x), by_hand(x))
    np.testing.assert_array_equal(_nnx_train(model, x, y), _nnx_train(by_hand, x, y))
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))


def test_nnx_rules():
    model = fp8_model(NnxModel(nnx.Rngs(0)),
                           [Fp8Rule(path="attention/.*", recipe=None),
                            Fp8Rule(path="head", recipe=jax_fp8.Float8BlockScaling(),
                                    min_fp8_flops=0), RULE])
    assert _n_states(fnnx.fp8_state(model)) == 2 * 3     # up and general
    assert isinstance(model.head.einsum_op, fnnx.Fp8Einsum)
    assert model.attention.query.dot_general is None            # excluded: as it was
    assert isinstance(fp8_model(Raw()), Raw)           # a linen model: a converted copy


class NnxMlp(nnx.Module):
    def __init__(self, d, rngs):
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.general = nnx.LinearGeneral(2 * d, (2, d // 2), rngs=rngs)
        self.head = nnx.Einsum("bd,dh->bh", (d, d), (d,), rngs=rngs)

    def __call__(self, x):
        return self.head(self.general(nnx.relu(self.up(x))).reshape(x.shape[0], -1))


def test_nnx_train_step_has_fp8_gemms():
    x, y = _data((16, 16), classes=16)
    model = fp8_model(NnxMlp(16, nnx.Rngs(0)),
                           [Fp8Rule(path="head", recipe=jax_fp8.Float8CurrentScaling(),
                                    min_fp8_flops=0),
                            RULE])

    def grads(state):
        model = nnx.merge(graphdef, state)
        return fnnx.fp8_value_and_grad(lambda m: _xent(m(x), y))(model)[1]
    graphdef, state = nnx.split(model)
    # up, general (delayed) and head (current scaling), 3 FP8 GEMMs each.
    assert _fp8_dots(grads, state) == 3 * 3
    graphdef, state = nnx.split(NnxMlp(16, nnx.Rngs(0)))
    assert _fp8_dots(lambda s: nnx.value_and_grad(
        lambda m: _xent(m(x), y))(nnx.merge(graphdef, s))[1], state) == 0


class NnxBlock(nnx.Module):
    def __init__(self, rngs, fp8=False):
        make = functools.partial(fnnx.Fp8Linear, recipe=RECIPE) if fp8 else nnx.Linear
        self.a = make(8, 8, rngs=rngs)
        self.b = make(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.b(nnx.gelu(self.a(x)))


class NnxStack(nnx.Module):
    """Layers made by nnx.vmap, applied by nnx.scan (Flax's layer-stacking pattern)."""

    def __init__(self, rngs, fp8=False):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NnxBlock(rngs, fp8)
        self.blocks = make(rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)
        return self.head(body(x, self.blocks))


def test_nnx_scan_over_vmap_stacked_layers_equals_the_hand_written_model():
    x, y = _data()
    model = fp8_model(NnxStack(nnx.Rngs(0)), [Fp8Rule(path="head", recipe=None), RULE])
    by_hand = NnxStack(nnx.Rngs(0), fp8=True)
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))
    np.testing.assert_array_equal(_nnx_train(model, x, y), _nnx_train(by_hand, x, y))
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))
    hist = np.asarray(model.blocks.a.dot_general.input.get_value().amax_history)
    assert hist.shape == (3, RECIPE.history_len) and np.all(np.any(hist > 0, axis=1))


class NnxRaw(nnx.Module):
    """A module's own GEMMs: an einsum with its kernel on the rhs, a dot_general with it
    on the lhs, and an attention-like product of two activations (left as it is)."""

    def __init__(self, rngs, fp8=False):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (8, 16)))
        self.w2 = nnx.Param(init(rngs.params(), (16, 4)))
        if fp8:   # the model written with jax_fp8's layers: a state per weight
            self.w1_fp8 = fnnx.Fp8Einsum(RECIPE)
            self.w2_fp8 = fnnx.Fp8DotGeneral(RECIPE)
        self.fp8 = fp8

    def __call__(self, x):
        if self.fp8:
            h = self.w1_fp8("bd,dh->bh", x, self.w1[...])
            h = h + jnp.einsum("bh,ch->bc", h, h) @ h / 16     # two activations
            return self.w2_fp8(nnx.relu(h), self.w2[...],
                                        (((1,), (0,)), ((), ())))
        h = jnp.einsum("bd,dh->bh", x, self.w1[...])
        h = h + jnp.einsum("bh,ch->bc", h, h) @ h / 16
        return jax.lax.dot_general(self.w2[...], nnx.relu(h), (((0,), (1,)), ((), ()))).T


def test_nnx_own_gemms_equal_the_hand_written_model():
    x, y = _data()
    model = fp8_model(NnxRaw(nnx.Rngs(0)), RULE, x)      # one eager call adds them
    by_hand = NnxRaw(nnx.Rngs(0), fp8=True)
    assert _n_states(fnnx.fp8_state(model)) == 2 * 3
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))
    np.testing.assert_array_equal(model(x), by_hand(x))
    np.testing.assert_array_equal(_nnx_train(model, x, y), _nnx_train(by_hand, x, y))
    assert_trees_equal(nnx.state(model), nnx.state(by_hand))
    assert type(model).__name__ == "NnxRaw" and isinstance(model, NnxRaw)
    assert jax.lax.dot_general is rules_lib.ORIGINAL["dot_general"]


def test_nnx_own_gemms_unseen_inside_jit_are_an_error():
    x, y = _data()
    model = fp8_model(NnxRaw(nnx.Rngs(0)), RULE)         # no example inputs
    with pytest.raises(ValueError, match="example inputs"):
        _nnx_train(model, x, y, steps=1)
    # Excluded, the module's own GEMMs stay as they are (and nothing is added).
    model = fp8_model(NnxRaw(nnx.Rngs(0)), Fp8Rule(recipe=None), x)
    assert _n_states(fnnx.fp8_state(model)) == 0
    np.testing.assert_array_equal(model(x), NnxRaw(nnx.Rngs(0))(x))


class NnxParent(nnx.Module):
    def __init__(self, rngs):
        self.child = NnxRaw(rngs)

    def __call__(self, x):
        h = self.child(x)
        return h + jnp.einsum("bh,ch->bc", h, h) @ h       # two activations, its own


def test_nnx_rules_apply_to_each_module_own_gemms():
    x, _ = _data()
    # The parent converts its activation GEMMs (the einsum and the @); the unmatched child
    # keeps all of its own.
    model = fp8_model(NnxParent(nnx.Rngs(0)),
                           [Fp8Rule(path="", recipe=RECIPE, activations=True, min_fp8_flops=0)], x)
    assert hasattr(model, "Fp8Einsum_0") and hasattr(model, "Fp8DotGeneral_0")
    assert not hasattr(model.child, "w1_fp8")
    assert _n_states(fnnx.fp8_state(model)) == 2 * 3
