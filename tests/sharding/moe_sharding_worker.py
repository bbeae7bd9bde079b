"""fp8_ragged_dot (delayed scaling, one state per expert) under a jit over 8 host devices: tokens
data-parallel, the experts' weights sharded over the devices along the experts' axis
(FSDP-style expert parallelism), and with their columns over a second axis; run by
test_moe_sharding.py. Prints one JSON line: per case, whether the output, both gradients
and the per-expert amaxes are one device's bits, the collectives of the compiled program,
and how many grouped GEMM primitives ran per device; and MaxText's sparse-matmul MoE (its
experts in a shard_map) converted by fp8_model."""

import collections
import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fp8
import moe_models as mm
from jax_fp8._primitives import base, grouped_gemm as gg
from jax_fp8.devtools import hlo
from jax_fp8.flax import Fp8Rule, fp8_model
from test_moe_conversion import _RAGGED, _executed
from test_ragged_dot import exact_operands

assert jax.device_count() == 8
M, K, N, G = 1024, 64, 32, 8
SIZES = np.array([100, 0, 300, 50, 200, 124, 150, 60], np.int32)   # 40 rows past them
RECIPE = jax_fp8.DelayedScaling(history_len=4)

rng = np.random.default_rng(0)
ends = np.cumsum(SIZES)
rows = [slice(int(e - s), int(e)) for s, e in zip(SIZES, ends)] + [slice(int(ends[-1]), M)]
x_np = exact_operands(rng, (M, K), rows, rng.integers(-2, 3, len(rows)))
ct_np = exact_operands(rng, (M, N), rows, rng.integers(-2, 3, len(rows)))
w_np = exact_operands(rng, (G, K, N), list(range(G)), rng.integers(-2, 3, G))
meta0 = jax_fp8.Fp8Meta.create(RECIPE, shape=(G,))
# power-of-two scales at or below 448 / amax (57344 / amax for the E5M2 gradient)
scales = {"input": 2.0 ** -4, "kernel": 2.0 ** -4, "grad": 2.0 ** 3}
meta0 = jax_fp8.Fp8Meta(**{
    r: jax_fp8.ScalingState(getattr(meta0, r).amax_history,
                            jnp.full((G,), scales[r], jnp.float32),
                            jnp.full((G,), 1 / scales[r], jnp.float32),
                            fp8_dtype=getattr(meta0, r).fp8_dtype)
    for r in jax_fp8.Fp8Meta.STATES})

MODES = {
    "dp": ((8,), ("data",), P(), P("data", None)),
    "ep": ((8,), ("data",), P("data", None, None), P("data", None)),
    "ep_tp": ((4, 2), ("data", "model"), P("data", None, "model"), P("data", None)),
}


def step(x, w, meta, ct):
    def fn(x, w, meta):
        return jax_fp8.fp8_ragged_dot(x, w, jnp.asarray(SIZES), meta)

    (out, meta_out), vjp = jax.vjp(fn, x, w, meta)
    dx, dw, dmeta = vjp((ct, jax.tree.map(jnp.zeros_like, meta_out)))
    return out, dx, dw, [getattr(dmeta, r).amax_history[:, 0] for r in jax_fp8.Fp8Meta.STATES]


def bits(tree):
    return [np.asarray(a).view(np.uint8).tobytes() for a in jax.tree.leaves(tree)]


reference = jax.jit(step)(x_np, w_np, meta0, ct_np)
results = {}
for mode, (shape, names, w_spec, x_spec) in MODES.items():
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    x = jax.device_put(x_np, NamedSharding(mesh, x_spec))
    ct = jax.device_put(ct_np, NamedSharding(mesh, x_spec))
    w = jax.device_put(w_np, NamedSharding(mesh, w_spec))
    meta = jax.device_put(meta0, NamedSharding(mesh, P()))
    jitted = jax.jit(step)
    got = jitted(x, w, meta, ct)
    compiled = jitted.lower(x, w, meta, ct).compile()
    text = compiled.as_text()
    gathers: dict = collections.defaultdict(list)
    for c in hlo.collectives(compiled):
        if c.opcode == "all-gather":
            gathers[",".join(c.dtypes)].append(c.bytes)
    per_device = text.count(base.per_device_scope(gg.TARGET))
    results[mode] = {
        "same_bits": [a == b for a, b in zip(bits(got), bits(reference))],
        "collectives": hlo.count_collectives(compiled),
        "all_reduce_kinds": hlo.all_reduce_kinds(compiled),
        "gathers": dict(gathers),
        "per_device_ops": per_device,
    }
# shard_map: each device its own tokens (sorted by expert, its own group sizes), every
# expert's weight and state replicated: the amaxes come back max-ed over the devices and
# the weight gradient summed, as one device given every device's groups would see them.
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
local_sizes = np.stack([np.roll(SIZES // 8, d) for d in range(8)]).astype(np.int32)


def local_step(x, sizes, w, meta, ct):
    def fn(x, w, meta):
        return jax_fp8.fp8_ragged_dot(x, w, sizes[0], meta)

    (out, meta_out), vjp = jax.vjp(fn, x, w, meta)
    _, dw, dmeta = vjp((ct, jax.tree.map(jnp.zeros_like, meta_out)))
    return out, dw, [getattr(dmeta, r).amax_history[:, 0] for r in jax_fp8.Fp8Meta.STATES]


sharded = jax.jit(jax.shard_map(local_step, mesh=mesh,
                                in_specs=(P("data"), P("data"), P(), P(), P("data")),
                                out_specs=(P("data"), P(), P())))
_, dw_sm, amax_sm = sharded(x_np, local_sizes, w_np, meta0, ct_np)
# the same groups on one device: device d's rows of expert g, for every d, as one group
spans = [[(d * (M // 8) + int(np.cumsum(local_sizes[d])[g] - local_sizes[d][g]),
             int(local_sizes[d][g])) for d in range(8)] for g in range(G)]
order = [r0 + i for g in range(G) for d in range(8) for (r0, n) in [spans[g][d]]
         for i in range(n)]
merged = np.bincount(np.repeat(np.arange(G), [sum(n for _, n in spans[g]) for g in
                                              range(G)]), minlength=G).astype(np.int32)
x_m, ct_m = x_np[order], ct_np[order]
pad = M - len(order)
x_m = np.concatenate([x_m, np.zeros((pad, K), np.float32)])
ct_m = np.concatenate([ct_m, np.zeros((pad, N), np.float32)])


def merged_step(x, w, meta, ct):
    def fn(x, w, meta):
        return jax_fp8.fp8_ragged_dot(x, w, jnp.asarray(merged), meta)

    (out, meta_out), vjp = jax.vjp(fn, x, w, meta)
    _, dw, dmeta = vjp((ct, jax.tree.map(jnp.zeros_like, meta_out)))
    return dw, [getattr(dmeta, r).amax_history[:, 0] for r in jax_fp8.Fp8Meta.STATES]


dw_one, amax_one = jax.jit(merged_step)(x_m, w_np, meta0, ct_m)
results["shard_map"] = {"same_bits": [a == b for a, b in zip(bits((dw_sm, amax_sm)),
                                                              bits((dw_one, amax_one)))]}

# MaxText's sparse-matmul MoE (tests/moe/moe_models.py), its experts in a shard_map over the
# 8 devices' tokens, converted by fp8_model with a stateless recipe: every grouped GEMM of
# the step in FP8 inside the shard_map, and each device's output the block's on its tokens
# alone (the router kept in float32, a GEMM per token).
RULES = [Fp8Rule(path="gate", recipe=None),
         Fp8Rule(recipe=jax_fp8.Float8CurrentScaling(), min_fp8_flops=0)]
x_mt = jax.random.normal(jax.random.key(0), (16, 8, 64))      # 2 sequences a device


def maxtext_block(devices):
    mesh_mt = jax.sharding.Mesh(np.array(devices), ("data",))
    return fp8_model(mm.LinenShardMapMoeBlock(16, 2, 64, 32, mesh=mesh_mt), RULES)


block8 = maxtext_block(jax.devices())
variables_mt = jax.jit(block8.init)(jax.random.key(1), x_mt)
loss_mt = jax.jit(jax.value_and_grad(
    lambda v, x: jnp.mean(block8.apply(v, x) ** 2), argnums=(0, 1)))
text_mt = loss_mt.trace(variables_mt, x_mt).lower(lowering_platforms=("cuda",)).as_text()
block1 = maxtext_block(jax.devices()[:1])
apply1 = jax.jit(block1.apply)
by_device = np.concatenate([np.asarray(apply1(variables_mt, x_mt[2 * d:2 * d + 2]))
                            for d in range(8)])
results["maxtext"] = {
    "same_bits": bits(jax.jit(block8.apply)(variables_mt, x_mt)) == bits(by_device),
    "ragged_dots": _executed(text_mt, _RAGGED),
}
print("RESULTS " + json.dumps(results))
