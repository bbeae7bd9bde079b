"""fp8_model on mixture-of-experts blocks written as public JAX MoE code writes them
(tests/moe/moe_models.py): each ``jax.lax.ragged_dot`` of an expert weight becomes an
`fp8_ragged_dot` with one FP8 state per expert, bit for bit the block written with
jax_fp8's functions; the router's GEMM follows the rules (``min_fp8_flops`` counts the
grouped GEMM as 2 * M * K * N); in the program lowered for CUDA, 3 FP8 grouped GEMMs per
expert projection (forward, input gradient, weight gradient); a training step updates the
per-expert states.
"""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_fp8
import moe_models as mm
from jax_fp8.flax import Fp8Rule, Fp8TrainState, fp8_model, nnx as fp8_nnx

E, D, F, TOP_K, T = 16, 64, 32, 2, 32         # experts, model dim, expert ffn, top-k, tokens
ROUTER_FLOPS = 2 * T * D * E                  # 65,536
EXPERT_FLOPS = 2 * T * TOP_K * D * F          # 262,144 per projection
DN = (((1,), (0,)), ((), ()))


def _x():
    return jax.random.normal(jax.random.key(0), (2, T // 2, D))


# ------------------------------------------------------ the block by hand, in jax_fp8

def manual_nnx(params, x, recipe):
    """NnxMoeBlock with fresh FP8 metas: the router an fp8_dot_general, each projection an
    fp8_ragged_dot with per-expert states."""
    tokens = x.reshape(-1, D)
    logits, _ = jax_fp8.fp8_dot_general(tokens, params["gate"], DN,
                                        jax_fp8.Fp8Meta.create(recipe))
    weights, selected = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), TOP_K)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    xs, sizes, unsort = mm.prepare_routing(jnp.repeat(tokens, TOP_K, axis=0),
                                           selected.ravel(), E)

    def ragged(a, w):
        return jax_fp8.fp8_ragged_dot(a, w, sizes, jax_fp8.Fp8Meta.create(recipe, shape=(E,)))[0]

    h = nnx.silu(ragged(xs, params["gate_proj"])) * ragged(xs, params["up_proj"])
    out = ragged(h, params["down_proj"])[unsort].reshape(-1, TOP_K, D)
    return jnp.sum(out * weights[..., None], axis=1).reshape(x.shape)


# Delayed scaling (a state per expert) and current scaling (no state): the conversion's two
# paths; the recipes without state differ only in fp8_ragged_dot's quantization, every
# recipe's bit for bit against the oracle in test_ragged_dot.py
# (test_every_recipe_bit_exact).
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.Float8CurrentScaling()}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_nnx_block_converted_bit_for_bit(name):
    recipe = RECIPES[name]
    model = mm.NnxMoeBlock(E, D, F, TOP_K, rngs=nnx.Rngs(0))
    params = {"gate": model.gate.kernel.get_value(),
              **{n: getattr(model.experts, n).get_value()
                 for n in ("gate_proj", "up_proj", "down_proj")}}
    x = _x()
    fp8_model(model, Fp8Rule(recipe=recipe, min_fp8_flops=0), x)
    got = model(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(manual_nnx(params, x, recipe)))
    layers = {n: getattr(model.experts, f"{n}_fp8", None)
              for n in ("gate_proj", "up_proj", "down_proj")}
    assert all(isinstance(v, fp8_nnx.Fp8RaggedDot) for v in layers.values()), layers
    if recipe.keeps_state:
        for layer in layers.values():
            assert layer.input.get_value().amax_history.shape == (E, recipe.history_len)


def test_nnx_training_updates_every_expert_state():
    model = mm.NnxMoeBlock(E, D, F, TOP_K, rngs=nnx.Rngs(0))
    x = _x()
    recipe = jax_fp8.DelayedScaling(history_len=8)
    fp8_model(model, Fp8Rule(recipe=recipe, min_fp8_flops=0), x)
    optimizer = fp8_nnx.Fp8Optimizer(model, optax.sgd(0.1), wrt=nnx.Param, recipe=recipe)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = fp8_nnx.fp8_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    step(model, optimizer, x)
    step(model, optimizer, x)
    fp8_nnx.check_fp8_updated(model)
    up = model.experts.up_proj_fp8
    routed = np.bincount(np.asarray(jax.lax.top_k(
        jax.nn.softmax(model.gate(x.reshape(-1, D)), -1), TOP_K)[1]).ravel(), minlength=E)
    scale = np.asarray(up.input.get_value().scale)
    # an expert that received tokens has its own scale; one that received none keeps 1
    assert (scale[routed > 0] != 1).all() and (scale[routed == 0] == 1).all()
    assert len(set(np.asarray(up.kernel.get_value().scale).tolist())) > 1


# ------------------------------------------------ linen, the rules, the CUDA program

_RAGGED = re.compile(r'"chlo\.ragged_dot"\([^)]*\)[^:]*: \((tensor<[^>]*>), (tensor<[^>]*>)')
_DOT = re.compile(r"stablehlo\.dot_general [^:]*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)")
_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)")
_CALL = re.compile(r"(?:func\.)?call @([\w.$-]+)")


def _executed(text, pattern):
    """Matches of `pattern` in @main and, once per call, in the functions it calls (the
    lowered program outlines functions called from several places)."""
    bodies, name = {}, None
    for line in text.splitlines():
        found = _FUNC.search(line)
        if found:
            name = found.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)

    def matches(fn):
        own = [m for line in bodies[fn] for m in pattern.findall(line)]
        for line in bodies[fn]:
            for callee in _CALL.findall(line):
                if callee in bodies:
                    own += matches(callee)
        return own

    return matches("main")


def _fp8(pair):
    return all("xf8" in t for t in pair)


def _lowered_step(rules):
    model = fp8_model(mm.LinenMoeBlock(E, TOP_K, D, F), rules)
    x = _x()
    variables = model.init(jax.random.key(1), x)

    def loss(params, fp8, x):
        return jnp.mean(model.apply({"params": params, **fp8}, x) ** 2)

    fp8 = {k: v for k, v in variables.items() if k != "params"}
    # the gradient w.r.t. x too: else the first projections' input gradients are dead code
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = step.trace(variables["params"], fp8, x).lower(lowering_platforms=("cuda",)).as_text()
    return variables, text


@pytest.mark.parametrize("rules,router_fp8,router_state", [
    (Fp8Rule(min_fp8_flops=0), True, True),
    ([Fp8Rule(path="gate", recipe=None), Fp8Rule(min_fp8_flops=0)], False, False),
    # the router below the threshold: its layer (and state) but its GEMMs kept
    (Fp8Rule(min_fp8_flops=(ROUTER_FLOPS + EXPERT_FLOPS) // 2), False, True)])
def test_linen_block_lowered_for_cuda(rules, router_fp8, router_state):
    """3 FP8 grouped GEMMs per expert projection (9), the router's 3 GEMMs FP8 or not as
    the rules say; the experts' states one per expert."""
    variables, text = _lowered_step(rules)
    grouped = [p for p in _executed(text, _RAGGED) if _fp8(p)]
    assert len(grouped) == 9, grouped
    # forward and input gradient ragged along the tokens (rhs [E, ., .]); weight gradient
    # ragged along the contraction (two 2-D FP8 operands)
    assert sum(p[1].count("x") == 3 for p in grouped) == 6
    router = [p for p in _executed(text, _DOT) if _fp8(p) and f"{E}x" in p[0] + p[1]]
    assert len(router) == (3 if router_fp8 else 0), router
    fp8 = variables["fp8_meta"]
    for name in ("wi_0", "wi_1", "wo"):
        assert fp8[f"{name}_fp8"]["kernel"].amax_history.shape == (E, 1024)
    assert ("gate" in fp8) == router_state


def test_min_fp8_flops_counts_the_grouped_gemm():
    """A threshold above the grouped GEMM's 2 * M * K * N keeps the experts' ragged_dots as
    they are (no state, no FP8); below it converts them."""
    _, text = _lowered_step(Fp8Rule(min_fp8_flops=EXPERT_FLOPS + 1))
    assert not [p for p in _executed(text, _RAGGED) if _fp8(p)]
    _, text = _lowered_step(Fp8Rule(min_fp8_flops=EXPERT_FLOPS))
    assert len([p for p in _executed(text, _RAGGED) if _fp8(p)]) == 9


def test_linen_training_step_with_fp8_train_state():
    model = fp8_model(mm.LinenMoeBlock(E, TOP_K, D, F), Fp8Rule(min_fp8_flops=0))
    x = _x()
    variables = model.init(jax.random.key(1), x)
    state = Fp8TrainState.create(apply_fn=model.apply, variables=variables,
                                 tx=optax.adam(1e-3))

    @jax.jit
    def step(state, x):
        def loss_fn(params, fp8):
            return jnp.mean(state.apply_model(params, fp8, x) ** 2)
        loss, grads = state.value_and_grad(loss_fn)()
        return state.apply_gradients(grads=grads), loss

    for _ in range(2):
        state, _ = step(state, x)
    jax_fp8.check_fp8_updated(state.fp8)
    assert (np.asarray(state.fp8["wo_fp8"]["kernel"].scale) != 1).all()


def _record(fn, *args):
    """``fn(*args)`` and the Fp8ConversionWarnings it emitted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in caught
                 if issubclass(w.category, jax_fp8.Fp8ConversionWarning)]


class Changed(nn.Module):
    """One grouped GEMM whose expert weight is changed before it (not followed)."""
    change: str
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, sizes):
        shape = (5 if self.change == "sliced" else 4, D, D)
        w = self.param("w", nn.initializers.lecun_normal(), shape, self.dtype)
        w = {"scaled": lambda: w * 0.5, "sliced": lambda: w[:4], "tanh": lambda: jnp.tanh(w),
             "as it is": lambda: w}[self.change]()
        return jax.lax.ragged_dot(x, w, sizes)


@pytest.mark.parametrize("change", ["scaled", "sliced", "tanh"])
def test_an_expert_weight_changed_before_the_grouped_gemm_is_reported(change):
    """w * 0.5, w[:G], jnp.tanh(w): not followed to the parameter, so the grouped GEMM runs
    as written (no state), and the block, which runs no GEMM in FP8, is reported once."""
    x, sizes = jax.random.normal(jax.random.key(2), (8, D)), jnp.array([2, 2, 2, 2], jnp.int32)
    fresh = type("Changed", (Changed,), {})   # a class of its own: reported once per model
    model = fp8_model(fresh(change), Fp8Rule(min_fp8_flops=0))
    variables = model.init(jax.random.key(0), x, sizes)
    assert "fp8_meta" not in variables
    out, caught = _record(model.apply, variables, x, sizes)
    assert len(caught) == 1, caught
    for part in ("root module (Changed)", "neither operand of its ragged_dot", "'w'"):
        assert part in caught[0], caught[0]
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(Changed(change).apply(variables, x, sizes)))
    assert not _record(model.apply, variables, x, sizes)[1]           # once per model


def test_a_float64_expert_weight_is_reported_naming_the_dtype():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(2), (8, D), jnp.float64)
        sizes = jnp.array([2, 2, 2, 2], jnp.int32)
        plain = type("Changed", (Changed,), {})("as it is", jnp.float64)
        model = fp8_model(plain, Fp8Rule(min_fp8_flops=0))
        variables = model.init(jax.random.key(0), x, sizes)
        assert "fp8_meta" not in variables
        out, caught = _record(model.apply, variables, x, sizes)
        assert len(caught) == 1 and "float64" in caught[0] and "grouped FP8 GEMM" in caught[0]
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(out),
                                      np.asarray(plain.apply(variables, x, sizes)))


class General(nn.Module):
    """The grouped GEMM spelled with ragged_dot_general: the expert weight [G, K, N]
    ("gkn"), [G, N, K] ("gnk"), or ragged_dot itself ("ragged_dot")."""
    form: str

    @nn.compact
    def __call__(self, x, sizes):
        shape = (4, F, D) if self.form == "gnk" else (4, D, F)
        w = self.param("w", nn.initializers.lecun_normal(), shape)
        if self.form == "ragged_dot":
            return jax.lax.ragged_dot(x, w, sizes)
        numbers = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [1 if self.form == "gkn" else 2]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(x, w, sizes, numbers)


@pytest.mark.parametrize("form", ["gkn", "gnk"])
def test_ragged_dot_general_is_converted_as_ragged_dot(form):
    """Both mixture-of-experts layouts of ragged_dot_general give what ragged_dot on the
    weight laid out [G, K, N] gives, bit for bit, with the same per-expert states."""
    x, sizes = jax.random.normal(jax.random.key(2), (40, D)), jnp.array([10, 0, 20, 6],
                                                                          jnp.int32)
    model, reference = (fp8_model(General(f), Fp8Rule(min_fp8_flops=0))
                        for f in (form, "ragged_dot"))
    variables = model.init(jax.random.key(0), x, sizes)
    assert variables["fp8_meta"]["w_fp8"]["kernel"].amax_history.shape == (4, 1024)
    w = variables["params"]["w"]
    ref_vars = {**variables, "params": {"w": jnp.swapaxes(w, 1, 2) if form == "gnk" else w}}
    out, caught = _record(model.apply, variables, x, sizes)
    assert not caught, caught
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(reference.apply(ref_vars, x, sizes)))

    def fp8_grads(m, v):
        return jax.grad(lambda f: jnp.sum(m.apply({**v, "fp8_meta": f}, x, sizes) ** 2))(
            v["fp8_meta"])

    for a, b in zip(jax.tree.leaves(jax_fp8.amax_cotangents(fp8_grads(model, variables))),
                    jax.tree.leaves(jax_fp8.amax_cotangents(fp8_grads(reference, ref_vars)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_another_ragged_dot_general_of_a_weight_is_reported():
    """ragged along the contraction (a weight gradient's form): no FP8 grouped GEMM takes
    it from a module, so it runs as written and is reported."""
    class Contraction(nn.Module):
        @nn.compact
        def __call__(self, x, sizes):
            w = self.param("w", nn.initializers.lecun_normal(), (8, F))
            numbers = jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1],
                rhs_group_dimensions=[])
            return jax.lax.ragged_dot_general(x, w, sizes, numbers)

    x, sizes = jax.random.normal(jax.random.key(2), (D, 8)), jnp.array([2, 2, 4], jnp.int32)
    model = fp8_model(Contraction(), Fp8Rule(min_fp8_flops=0))
    variables = model.init(jax.random.key(0), x, sizes)
    out, caught = _record(model.apply, variables, x, sizes)
    assert len(caught) == 1 and "ragged_dot_general" in caught[0], caught
    assert "mixture-of-experts" in caught[0]
    np.testing.assert_array_equal(np.asarray(out),
                                  np.asarray(Contraction().apply(variables, x, sizes)))


# --------------------------------------------------------------------------- Equinox

def test_equinox_ragged_dot_stateless_recipe_and_delayed_refused():
    """Equinox: a module's ragged_dot of its expert weight runs as fp8_ragged_dot for a
    recipe without state (bit for bit the function); delayed scaling, whose state is one
    per expert, is refused naming the fix."""
    eqx = pytest.importorskip("equinox")
    from jax_fp8 import equinox as jfe

    class Experts(eqx.Module):
        w: jax.Array

        def __call__(self, x, sizes):
            return jax.lax.ragged_dot(x, self.w, sizes)

    w = jax.random.normal(jax.random.key(0), (4, D, F))
    x, sizes = jax.random.normal(jax.random.key(1), (40, D)), jnp.array([10, 0, 20, 6],
                                                                          jnp.int32)
    recipe = jax_fp8.Float8CurrentScaling()
    got = jfe.fp8_model(Experts(w), Fp8Rule(recipe=recipe, min_fp8_flops=0))(x, sizes)
    want = jax_fp8.fp8_ragged_dot(x, w, sizes, jax_fp8.Fp8Meta.create(recipe))[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    converted = jfe.fp8_model(Experts(w), Fp8Rule(min_fp8_flops=0))
    with pytest.raises(ValueError, match="one per expert"):
        converted(x, sizes)
