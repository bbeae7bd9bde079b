"""fp8_model on mixture-of-experts blocks written as public JAX MoE code writes them
(tests/moe/moe_models.py): each ``jax.lax.ragged_dot`` of an expert weight becomes an
`fp8_ragged_dot` with one FP8 state per expert, bit for bit the block written with
jax_fp8's functions; the router's GEMM follows the rules (``min_fp8_flops`` counts the
grouped GEMM as 2 * M * K * N); in the program lowered for CUDA, 3 FP8 grouped GEMMs per
expert projection (forward, input gradient, weight gradient); a training step updates the
per-expert states.
"""

import re

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


RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.Float8CurrentScaling(),
           "block": jax_fp8.Float8BlockScaling(), "mxfp8": jax_fp8.MXFP8BlockScaling()}


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


def test_ragged_dot_of_activations_stays():
    """A ragged_dot whose rhs is no parameter (e.g. weights computed from activations) is
    left as it is."""
    class Computed(nn.Module):
        @nn.compact
        def __call__(self, x, sizes):
            w = self.param("w", nn.initializers.lecun_normal(), (4, D, D))
            return jax.lax.ragged_dot(x, jnp.tanh(w), sizes)

    x, sizes = jnp.ones((8, D)), jnp.array([2, 2, 2, 2], jnp.int32)
    model = fp8_model(Computed(), Fp8Rule(min_fp8_flops=0))
    variables = model.init(jax.random.key(0), x, sizes)
    assert "fp8_meta" not in variables
    np.testing.assert_array_equal(np.asarray(model.apply(variables, x, sizes)),
                                  np.asarray(Computed().apply(variables, x, sizes)))


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
