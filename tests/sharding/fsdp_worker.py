"""FSDP FP8 train steps on 8 host devices: the sharded weights are quantized where they live
and all-gathered as FP8. Run by test_fsdp.py; prints one JSON line with, per case, the
all-gathers of the partitioned program (before XLA:CPU widens FP8 collectives) by dtype,
those of the same step in bf16, and whether the sharded step equals the one-device step
bit for bit."""

import json
import os

# Bit comparisons against the one-device step need XLA to round every bf16 intermediate
# in both programs: with excess precision allowed (its default) a fusion may quantize an
# activation from its unrounded float32 value, and the two programs fuse differently.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8
from jax_fp8.flax import Fp8DotGeneral, Fp8TrainState
from partition_checks import bits_equal, gathers

assert jax.device_count() == 8
DN = (((1,), (0,)), ((), ()))
LAYERS, D, ROWS = 4, 256, 64
RECIPE = jax_fp8.DelayedScaling(history_len=16)


rng = np.random.default_rng(0)
ws_np = [(rng.standard_normal((D, D)) / 16).astype(np.float32) for _ in range(LAYERS)]
x_np = rng.standard_normal((ROWS, D)).astype(np.float32)


def functional_case(mesh, w_spec, x_spec, fp8=True):
    """Plain functions: bf16 compute of float32 weights, adam-free SGD step."""

    def loss(ws, metas, x):
        h = x.astype(jnp.bfloat16)
        for w, m in zip(ws, metas):
            w = w.astype(jnp.bfloat16)
            h = jax_fp8.fp8_dot_general(h, w, DN, m)[0] if fp8 else h @ w
            h = jax.nn.gelu(h)
        return jnp.mean(h.astype(jnp.float32) ** 2), h

    def step(ws, metas, x):
        (g, fg), out = jax.grad(loss, argnums=(0, 1), has_aux=True)(ws, metas, x)
        new_metas = jax_fp8.new_fp8_state(metas, fg, RECIPE) if fp8 else metas
        return [w - 0.5 * gw for w, gw in zip(ws, g)], new_metas, out

    metas = [jax_fp8.Fp8Meta.create(RECIPE) for _ in range(LAYERS)]
    args = (ws_np, metas, x_np)
    sharded = jax.device_put(args, (NamedSharding(mesh, w_spec), NamedSharding(mesh, P()),
                                    NamedSharding(mesh, x_spec)))
    with jax.set_mesh(mesh):
        lowered = jax.jit(step).lower(*sharded)
        got = jax.jit(step)(*sharded)
    want = jax.jit(step)(*jax.device_put(args, jax.devices()[0]))
    # The weight gradients sum over devices in another order than on one device, so the
    # new weights may differ in their last bits; the forward output and the FP8 state
    # (amaxes are maxima) must not.
    return {"gathers": gathers(lowered),
            "output_and_fp8_state_equal_one_device": bits_equal(got[1:], want[1:]),
            "weights_max_diff_over_max": max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))
                for a, b in zip(got[0], want[0])),
            "scales_moved": bool(fp8) and any(float(m.kernel.scale) != 1.0 for m in got[1])}


def current_scaling_case(mesh):
    """Float8CurrentScaling: the weight's scale is its global amax (one max over devices),
    its shard quantized where it lives and gathered as FP8 too."""
    meta = jax_fp8.Fp8Meta.create(jax_fp8.Float8CurrentScaling())

    def loss(ws, x):
        h = x.astype(jnp.bfloat16)
        for w in ws:
            h = jax.nn.gelu(jax_fp8.fp8_dot_general(h, w.astype(jnp.bfloat16), DN, meta)[0])
        return jnp.mean(h.astype(jnp.float32) ** 2), h

    step = jax.jit(jax.grad(loss, has_aux=True))
    sharded = jax.device_put((ws_np, x_np), (NamedSharding(mesh, P("fsdp", None)),
                                             NamedSharding(mesh, P(("data", "fsdp"), None))))
    got = step(*sharded)
    want = step(*jax.device_put((ws_np, x_np), jax.devices()[0]))
    return {"gathers": gathers(step.lower(*sharded)),
            "output_equal_one_device": bits_equal(got[1], want[1])}


class Mlp(nn.Module):
    fp8: bool = True

    @nn.compact
    def __call__(self, x):
        for _ in range(LAYERS):
            x = nn.Dense(D, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                         dot_general_cls=Fp8DotGeneral if self.fp8 else None)(x)
            x = nn.gelu(x)
        return x


def flax_case(mesh, fp8=True):
    """Flax linen Dense layers, Fp8TrainState (packed FP8 state), adam; kernels and adam's
    moments sharded over "fsdp" on their rows."""
    model = Mlp(fp8)
    x = jnp.asarray(x_np, jnp.bfloat16)
    variables = model.init(jax.random.key(0), x)
    tx = optax.adam(1e-3)
    if fp8:
        state = Fp8TrainState.create(apply_fn=model.apply, variables=variables, tx=tx)
    else:
        from flax.training.train_state import TrainState
        state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)

    def spec(path, leaf):
        is_kernel = getattr(leaf, "ndim", 0) == 2 and "kernel" in jax.tree_util.keystr(path)
        return NamedSharding(mesh, P("fsdp", None) if is_kernel else P())

    shardings = jax.tree_util.tree_map_with_path(spec, state)

    def step(state, x):
        if fp8:
            def loss(params, fp8_state):
                return jnp.mean(state.apply_model(params, fp8_state, x).astype(jnp.float32) ** 2)
            grads, fp8_grads = jax.grad(loss, argnums=(0, 1))(state.params, state.fp8)
            return state.apply_gradients(grads=grads, fp8_grads=fp8_grads)
        grads = jax.grad(lambda p: jnp.mean(
            state.apply_fn({"params": p}, x).astype(jnp.float32) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    jitted = jax.jit(step, out_shardings=shardings)
    sharded = (jax.device_put(state, shardings),
               jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None))))
    got = jitted(*sharded)
    want = jax.jit(step)(*jax.device_put((state, x), jax.devices()[0]))
    return {"gathers": gathers(jitted.lower(*sharded)),
            "fp8_state_equal_one_device": bool(fp8) and bits_equal(got.fp8, want.fp8)}


auto = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
explicit = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
batch = P(("data", "fsdp"), None)
results = {
    "rows": functional_case(auto, P("fsdp", None), batch),
    "rows_bf16": functional_case(auto, P("fsdp", None), batch, fp8=False),
    "cols": functional_case(auto, P(None, "fsdp"), batch),
    "rows_explicit": functional_case(explicit, P("fsdp", None), batch),
    "rows_current": current_scaling_case(auto),
    "flax": flax_case(auto),
    "flax_bf16": flax_case(auto, fp8=False),
}
print("RESULTS " + json.dumps(results))
