"""jax_fp8.flax (linen): Fp8DotGeneral in Dense/DenseGeneral, Fp8Einsum, Fp8TrainState."""

import functools
import importlib.util
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jax_fp8
from helpers import rand
from jax_fp8.flax import FP8_COLLECTION, Fp8DotGeneral, Fp8Einsum, Fp8TrainState

RECIPE = jax_fp8.DelayedScaling(history_len=8)
DG = functools.partial(Fp8DotGeneral, recipe=RECIPE)
# Gradient clipping and weight decay: neither may touch the FP8 state.
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-2, weight_decay=0.1))
IS_STATE = lambda x: isinstance(x, jax_fp8.ScalingState)  # noqa: E731


def staged(fp8_grads):
    """{path: amax} of the staging slots of a gradient tree."""
    flat = jax.tree_util.tree_flatten_with_path(jax_fp8.amax_cotangents(fp8_grads))[0]
    return {jax.tree_util.keystr(p): np.asarray(v).tolist() for p, v in flat}


def fp8_grads_of(model, variables, *args):
    params, fp8 = variables["params"], variables[FP8_COLLECTION]

    @jax.jit
    def g(params, fp8):
        def loss(fp8):
            out, _ = model.apply({"params": params, FP8_COLLECTION: fp8}, *args,
                                 mutable=[FP8_COLLECTION])
            return jnp.sum(jnp.sin(out))
        return jax.grad(loss)(fp8)

    return g(params, fp8)


class MLP(nn.Module):
    features: tuple = (16, 16, 4)
    dot_general_cls: object = DG

    @nn.compact
    def __call__(self, x):
        for i, f in enumerate(self.features):
            x = nn.Dense(f, dot_general_cls=self.dot_general_cls)(x)
            if i + 1 < len(self.features):
                x = nn.relu(x)
        return x


def test_dense_variables_and_forward():
    x = rand(0, (4, 8))
    model = nn.Dense(6, dot_general_cls=DG)
    v = jax.jit(model.init)(jax.random.key(0), x)
    assert set(v) == {"params", FP8_COLLECTION}
    plain = jax.jit(nn.Dense(6).init)(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, v["params"], plain["params"])
    meta = v[FP8_COLLECTION]["Fp8DotGeneral_0"]
    assert set(meta) == {"input", "kernel", "grad"}
    assert meta["input"].fp8_dtype == jnp.float8_e4m3fn
    assert meta["grad"].fp8_dtype == jnp.float8_e5m2            # HYBRID
    assert meta["input"].amax_history.shape == (8,) and meta["input"].scale.shape == ()
    out, out_immutable, want = jax.jit(lambda v, x: (
        model.apply(v, x, mutable=[FP8_COLLECTION])[0],
        model.apply(v, x, mutable=False),       # inference: no mutable collection needed
        jax_fp8.fp8_dot_general(x, v["params"]["kernel"], (((1,), (0,)), ((), ())),
                            jax_fp8.Fp8Meta(**v[FP8_COLLECTION]["Fp8DotGeneral_0"]))[0]
        + v["params"]["bias"]))(v, x)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out, out_immutable)


def test_dense_general_with_batch_dims_and_einsum_module():
    x = rand(1, (4, 3, 5, 6))                       # [heads, batch, seq, head_dim]
    for kw, shape in (({"features": 7, "axis": -1, "batch_dims": (0,)}, (4, 3, 5, 7)),
                      ({"features": (2, 3), "axis": (-2, -1)}, (4, 3, 2, 3))):
        dg = nn.DenseGeneral(dot_general_cls=DG, **kw)
        v = jax.jit(dg.init)(jax.random.key(0), x)
        out, want = jax.jit(lambda v, x: (dg.apply(v, x), nn.DenseGeneral(**kw).apply(
            {"params": v["params"]}, x)))(v, x)
        assert out.shape == want.shape == shape
        # scale 1 and |x| < 448: only E4M3 rounding (< 2**-4 relative per operand).
        assert float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want)) < 0.08

    x = jnp.transpose(x, (1, 2, 0, 3))             # [batch, seq, heads, head_dim]

    class Proj(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param("kernel", nn.initializers.lecun_normal(), (4, 6, 8))
            return Fp8Einsum(recipe=RECIPE)("bshd,hdo->bso", x, k)

    v = jax.jit(Proj().init)(jax.random.key(1), x)
    out = jax.jit(Proj().apply)(v, x)
    want = jnp.einsum("bshd,hdo->bso", x, v["params"]["kernel"])
    assert float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want)) < 0.08
    assert v[FP8_COLLECTION]["Fp8Einsum_0"]["kernel"].fp8_dtype == jnp.float8_e4m3fn


def _make_state(tx, x, model=None):
    model = MLP() if model is None else model
    v = jax.jit(model.init)(jax.random.key(0), x)
    return model, Fp8TrainState.create(apply_fn=model.apply, variables=v, tx=tx,
                                       recipe=RECIPE)


def _loss_fn(state, x, y):
    def loss(params, fp8):
        return jnp.mean((state.apply_model(params, fp8, x) - y) ** 2)
    return loss


@jax.jit
def _train_step(state, x, y):
    loss, (grads, fp8_grads) = jax.value_and_grad(_loss_fn(state, x, y), argnums=(0, 1))(
        state.params, state.fp8)
    return state.apply_gradients(grads=grads, fp8_grads=fp8_grads), loss, grads, fp8_grads


def test_train_state_keeps_fp8_out_of_the_optimizer_and_trains():
    x = rand(0, (64, 8))
    y = jnp.tanh(x @ rand(1, (8, 4)))
    _, state = _make_state(TX, x)
    assert FP8_COLLECTION not in state.params
    # The optimizer state is exactly that of a plain TrainState over the params.
    plain = train_state.TrainState.create(apply_fn=MLP(dot_general_cls=None).apply,
                                          params=state.params, tx=TX)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(plain.opt_state)
    new, loss0, grads, fp8_grads = _train_step(state, x, y)
    # params: exactly the plain TrainState update with the same gradients.
    want = jax.jit(lambda s, g: s.apply_gradients(grads=g).params)(plain, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9),
                 new.params, want)
    # fp8: exactly one fused update driven by the FP8 gradients (no clipping, no decay).
    jax.tree.map(np.testing.assert_array_equal, new.fp8,
                 jax.jit(jax_fp8.new_fp8_state, static_argnums=2)(state.fp8, fp8_grads, RECIPE))
    # The first step's amaxes are now the newest history entries.
    meta = jax_fp8.unpack_states(new.fp8)["Dense_0"]["Fp8DotGeneral_0"]
    assert float(meta["input"].amax_history[-1]) == float(jax_fp8.compute_amax(x))
    assert float(meta["kernel"].amax_history[-1]) == float(
        jax_fp8.compute_amax(state.params["Dense_0"]["kernel"]))
    assert float(meta["input"].scale) == pytest.approx(448 / float(jax_fp8.compute_amax(x)))

    # Training: the loss falls and tracks the same model trained without FP8.
    @jax.jit
    def ref_step(s):
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((s.apply_fn({"params": p}, x) - y) ** 2))(s.params)
        return s.apply_gradients(grads=g), loss

    state, ref, losses, ref_losses = new, plain, [float(loss0)], []
    ref, ref_loss = ref_step(ref)
    ref_losses.append(float(ref_loss))
    for _ in range(29):
        state, loss, _, _ = _train_step(state, x, y)
        ref, ref_loss = ref_step(ref)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    assert losses[-1] < 0.3 * losses[0]
    # FP8 lags the unquantized model by a step or two: after 30 steps 0.061 against 0.049
    # on the CPU, 0.063 against 0.048 on an H200 (25-32 % above; a bound of 25 % failed
    # on the GPU). 40 % still fails a run that stalls or diverges.
    assert abs(losses[-1] - ref_losses[-1]) < 0.4 * ref_losses[-1] + 2e-3


def test_reused_module_amaxes_combine_by_max(on_cpu):
    class Shared(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nn.Dense(8, dot_general_cls=DG, name="shared")
            for _ in range(3):
                x = jnp.tanh(d(x))
            return x

    class Separate(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = jnp.tanh(nn.Dense(8, dot_general_cls=DG, name=f"d{i}")(x))
            return x

    x = rand(0, (4, 8), 3.0)
    v = jax.jit(Shared().init)(jax.random.key(0), x)
    p = v["params"]["shared"]
    sep_v = {"params": {f"d{i}": p for i in range(3)},
             FP8_COLLECTION: {f"d{i}": v[FP8_COLLECTION]["shared"] for i in range(3)}}
    got = staged(fp8_grads_of(Shared(), v, x))
    per_use = staged(fp8_grads_of(Separate(), sep_v, x))
    for name in ("input", "kernel", "grad"):
        uses = [per_use[f"['d{i}']['Fp8DotGeneral_0']['{name}']"] for i in range(3)]
        assert got[f"['shared']['Fp8DotGeneral_0']['{name}']"] == max(uses)
        if name != "kernel":
            assert got[f"['shared']['Fp8DotGeneral_0']['{name}']"] < sum(uses)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(8, dot_general_cls=DG)(x)), None


def test_nn_scan_over_layers_gives_each_layer_its_own_state(on_cpu):
    n = 3
    Stack = nn.scan(Block, variable_axes={"params": 0, FP8_COLLECTION: 0},
                    split_rngs={"params": True}, length=n)

    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Stack(name="stack")(x, None)[0]

    class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(n):
                x = Block(name=f"b{i}")(x, None)[0]
            return x

    x = rand(0, (4, 8), 2.0)
    v = jax.jit(Scanned().init)(jax.random.key(0), x)
    fp8 = v[FP8_COLLECTION]["stack"]["Dense_0"]["Fp8DotGeneral_0"]
    assert fp8["input"].amax_history.shape == (n, 8) and fp8["input"].scale.shape == (n,)
    sl = lambda t, i: jax.tree.map(lambda a: a[i], t)  # noqa: E731
    un_v = {c: {f"b{i}": sl(v[c]["stack"], i) for i in range(n)}
            for c in ("params", FP8_COLLECTION)}
    g_scan = fp8_grads_of(Scanned(), v, x)
    g_unrolled = staged(fp8_grads_of(Unrolled(), un_v, x))
    got = staged(g_scan)
    for name in ("input", "kernel", "grad"):
        want = [g_unrolled[f"['b{i}']['Dense_0']['Fp8DotGeneral_0']['{name}']"]
                for i in range(n)]
        np.testing.assert_array_equal(
            got[f"['stack']['Dense_0']['Fp8DotGeneral_0']['{name}']"], want)
    # One fused update for the stacked [n, L] states.
    new = jax_fp8.new_fp8_state(v[FP8_COLLECTION], g_scan, RECIPE)
    np.testing.assert_array_equal(
        new["stack"]["Dense_0"]["Fp8DotGeneral_0"]["kernel"].amax_history[:, -1],
        [float(jax_fp8.compute_amax(k)) for k in v["params"]["stack"]["Dense_0"]["kernel"]])


def test_nn_scan_reusing_one_layer_carries_its_state(on_cpu):
    n = 3
    Loop = nn.scan(Block, variable_broadcast="params", variable_carry=FP8_COLLECTION,
                   split_rngs={"params": False}, length=n)

    class Looped(nn.Module):
        @nn.compact
        def __call__(self, x):
            # A carried collection must exist before the scan: create it unscanned at init
            # (same variables: params are broadcast, the FP8 state is carried).
            if self.is_initializing():
                Block(name="loop")(x, None)
                return x
            return Loop(name="loop")(x, None)[0]

    class Unrolled(nn.Module):
        @nn.compact
        def __call__(self, x):
            blk = Block(name="loop")
            for _ in range(n):
                x = blk(x, None)[0]
            return x

    x = rand(0, (4, 8), 3.0)
    v = jax.jit(Looped().init)(jax.random.key(0), x)
    got = staged(fp8_grads_of(Looped(), v, x))
    want = staged(fp8_grads_of(Unrolled(), v, x))
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


def test_gradient_accumulation_over_microbatches(on_cpu):
    x, y = rand(0, (32, 8), 2.0), rand(1, (32, 4))
    x = x.at[3].multiply(8.0)
    _, state = _make_state(optax.sgd(0.1), x)

    def loss(params, fp8, xb, yb):
        return jnp.sum((state.apply_model(params, fp8, xb) - yb) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))

    @jax.jit
    def accumulated(state):
        def body(acc, batch):
            g, fg = grad(state.params, state.fp8, *batch)
            return (jax.tree.map(jnp.add, acc[0], g), jax_fp8.combine_fp8_grads(acc[1], fg)), None
        zeros = jax.tree.map(jnp.zeros_like, (state.params, state.fp8))
        (g, fg), _ = jax.lax.scan(body, zeros, (x.reshape(4, 8, 8), y.reshape(4, 8, 4)))
        return g, fg

    g, fg = accumulated(state)
    g_full, fg_full = jax.jit(grad)(state.params, state.fp8, x, y)
    assert staged(fg) == staged(fg_full)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-4), g, g_full)


def test_create_rejects_other_collections():
    with pytest.raises(ValueError, match="batch_stats"):
        Fp8TrainState.create(apply_fn=None, tx=optax.sgd(1.0),
                             variables={"params": {}, FP8_COLLECTION: {}, "batch_stats": {}})


def _load_demo():
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_fp8_lm.py"
    spec = importlib.util.spec_from_file_location("train_fp8_lm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod       # dataclasses (flax modules) look their module up
    spec.loader.exec_module(mod)
    return mod
