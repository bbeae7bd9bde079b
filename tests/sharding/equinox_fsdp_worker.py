"""An Equinox transformer converted by jax_fp8.equinox.fp8_model, trained FSDP-style on 8 host
devices (each projection's weight sharded over the mesh, eqx.filter_shard, the batch over
the mesh). Run by test_equinox_fsdp.py; prints one RESULTS JSON line, per recipe: the
all-gathers of the partitioned program by dtype, the FP8 GEMMs of the partitioned program,
and how far the sharded step's loss and new FP8 state are from the one-device step's
(relative to the largest value: the two programs sum over the batch in another order)."""

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_fp8
import jax_fp8.equinox as jfe
from eqx_models import Transformer, lm_train_step
from jax_fp8.devtools import compilation, hlo
from partition_checks import gathers

assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
RECIPES = {"delayed": jax_fp8.DelayedScaling(history_len=8),
           "current": jax_fp8.Float8CurrentScaling()}
optim = optax.adamw(1e-3)


def shardings(dynamic):
    """FSDP: each projection's weight sharded over its output rows (an Fp8Linear's weight:
    a path ending in ``.weight`` with two axes, the embedding table aside), everything
    else replicated."""
    def spec(path, x):
        name = jax.tree_util.keystr(path)
        if name.endswith(".weight") and x.ndim == 2 and "embedder" not in name:
            return NamedSharding(mesh, P("fsdp", None))
        return NamedSharding(mesh, P())
    return jax.tree_util.tree_map_with_path(spec, dynamic)


def case(recipe):
    model = jfe.fp8_model(Transformer(64, 64, 128, 4, 1, key=jr.key(0)),
                          jax_fp8.Fp8Rule(recipe=recipe, min_fp8_flops=0))
    dynamic, static = eqx.partition(model, eqx.is_array)
    opt_state = optim.init(jfe.params(model))
    tokens = jr.randint(jr.key(1), (8, 9), 0, 64)
    weight_shardings = shardings(dynamic)
    one_device = lm_train_step(static, optim)

    def step(dynamic, opt_state, tokens):
        return one_device(eqx.filter_shard(dynamic, weight_shardings), opt_state, tokens)

    jitted = jax.jit(step)
    tokens_sharded = jax.device_put(tokens, NamedSharding(mesh, P("fsdp", None)))
    lowered = jitted.lower(dynamic, opt_state, tokens_sharded)
    got = jitted(dynamic, opt_state, tokens_sharded)
    one = jax.device_put((dynamic, opt_state, tokens), jax.devices()[0])
    want = jax.jit(one_device)(*one)
    fp8 = [(s.meta, w.meta) for (_, s), (_, w) in zip(
        jfe.fp8_states(eqx.combine(got[0], static)), jfe.fp8_states(eqx.combine(want[0], static)))]
    partitioned = compilation.partitioned(lowered)
    gemms = hlo.gemms(partitioned)
    return {"gathers": gathers(lowered),
            "fp8_gemms": sum(g.fp8 for g in gemms), "gemms": len(gemms),
            "projections": len(jfe.fp8_states(model)),
            "loss_rel_diff": rel_diff(got[2], want[2]),
            "fp8_state_rel_diff": max([rel_diff(a, b) for x, y in fp8
                                       for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y))],
                                      default=0.0),
            "scales_moved": any(float(np.max(np.abs(np.asarray(x.kernel.scale) - 1))) > 0
                                for x, _ in fp8 if x.kernel is not None)}


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


results = {name: case(recipe) for name, recipe in RECIPES.items()}
print("RESULTS " + json.dumps(results))
