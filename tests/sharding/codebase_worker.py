"""T5X- and MaxText-style projections (flax_models/codebase_layers.py) converted by fp8_model,
on a data x model mesh of 8 host devices under their codebase's logical axis rules (T5X's
standard_logical_axis_rules; param_with_axes and nn.with_logical_partitioning constrain
each kernel over 'model'). Run by test_codebase_sharding.py; prints one RESULTS JSON line:
per codebase and recipe, the FP8 GEMMs of the program after XLA's SPMD partitioner (dots of
two FP8 operands; block scaling: its GEMM's reference dots of FP8 operands widened, read
from the program's decisions), whether the converted model's loss and gradients equal the
hand-written FP8 model's bit for bit, and the Fp8ConversionWarnings raised."""

import json
import os
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from flax.linen import partitioning as nn_partitioning  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import codebase_layers as cl  # noqa: E402
import jax_fp8  # noqa: E402
from jax_fp8.devtools import compilation, explain, hlo  # noqa: E402
from jax_fp8.flax import Fp8ConversionWarning, Fp8Rule, fp8_model  # noqa: E402

assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
RECIPES = {"delayed": jax_fp8.DelayedScaling(history_len=4),
           "current": jax_fp8.Float8CurrentScaling(),
           "block": jax_fp8.Float8BlockScaling(),
           "mxfp8": jax_fp8.MXFP8BlockScaling()}
RULES = {"t5x": cl.standard_logical_axis_rules(),
         "maxtext": cl.MAXTEXT_RULES, "nnx": cl.MAXTEXT_RULES}


def fp8_gemms(name, lowered, step, *args):
    if name in ("delayed", "current"):
        return sum(g.fp8 for g in hlo.gemms(compilation.partitioned(lowered)))
    rows = explain.explain(step, *args, num_devices=8)
    if name == "block":
        return sum(r.name == "jax_fp8_block_gemm" for r in rows)
    return sum(r.kind == "gemm" and r.lowering.startswith("mxfp8") for r in rows)


def linen_case(codebase, name):
    recipe = RECIPES[name]
    e = 128 if name == "block" else 32
    make = {"t5x": lambda fp8=None: cl.T5xBlock(num_heads=2, head_dim=e // 2,
                                               mlp_dim=2 * e, fp8=fp8),
            "maxtext": lambda fp8=None: cl.MaxTextMlpBlock(intermediate_dim=2 * e, fp8=fp8)}
    hand = make[codebase](recipe)
    converted = fp8_model(make[codebase](), Fp8Rule(recipe=recipe))
    x = jax.random.normal(jax.random.key(0), (8, 16, e))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    variables = hand.init(jax.random.key(1), x)

    def step_of(model):
        def loss(variables, x):
            return jnp.mean(model.apply(variables, x).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1))

    step = step_of(converted)
    lowered = jax.jit(step).lower(variables, x)
    got = jax.jit(step)(variables, x)
    want = jax.jit(step_of(hand))(variables, x)
    # The kernels reach their GEMMs through sharding constraints (param_with_axes,
    # nn.with_logical_partitioning under the rules).
    constraints = str(jax.make_jaxpr(step)(variables, x)).count("sharding_constraint")
    return fp8_gemms(name, lowered, step, variables, x), got, want, constraints


def nnx_case(name):
    recipe = RECIPES[name]
    e = 128 if name == "block" else 32
    x = jax.random.normal(jax.random.key(0), (8, 16, e))
    with nnx.use_eager_sharding(False):
        hand = cl.NnxMlpBlock(e, intermediate_dim=2 * e, fp8=recipe, rngs=nnx.Rngs(1))
        plain = cl.NnxMlpBlock(e, intermediate_dim=2 * e, rngs=nnx.Rngs(1))
    converted = fp8_model(plain, Fp8Rule(recipe=recipe), x)

    def sharded(model):
        graphdef, state = nnx.split(model)
        specs = nnx.get_partition_spec(state)
        shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES["nnx"])
        return graphdef, jax.device_put(state, shardings)

    def step_of(graphdef):
        def step(state, x):
            model = nnx.merge(graphdef, state)

            def loss(model, x):
                return jnp.mean(model(x).astype(jnp.float32) ** 2)
            diff = nnx.DiffState(0, nnx.Any(nnx.Param, jax_fp8.flax.nnx.Fp8State))
            out, grads = nnx.value_and_grad(loss, argnums=(diff, 1))(model, x)
            return out, jax.tree.leaves(grads)
        return step

    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    g_conv, s_conv = sharded(converted)
    g_hand, s_hand = sharded(hand)
    step = step_of(g_conv)
    lowered = jax.jit(step).lower(s_conv, x)
    got = jax.jit(step)(s_conv, x)
    want = jax.jit(step_of(g_hand))(s_hand, x)
    return fp8_gemms(name, lowered, step, s_conv, x), got, want, None


def equal(a, b) -> bool:
    try:
        jax.tree.map(np.testing.assert_array_equal, a, b)
    except AssertionError:
        return False
    return True


results = {}
projections = {"t5x": cl.T5X_PROJECTIONS, "maxtext": cl.MAXTEXT_PROJECTIONS,
               "nnx": cl.MAXTEXT_PROJECTIONS}
for codebase in ("t5x", "maxtext", "nnx"):
    for name in RECIPES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with jax.set_mesh(mesh), nn_partitioning.axis_rules(RULES[codebase]):
                if codebase == "nnx":
                    count, got, want, constraints = nnx_case(name)
                else:
                    count, got, want, constraints = linen_case(codebase, name)
        results[f"{codebase}/{name}"] = {
            "fp8_gemms": count, "projections": projections[codebase],
            "sharding_constraints": constraints,
            "equal_to_hand_written": equal(got, want),
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, Fp8ConversionWarning)]}
print("RESULTS " + json.dumps(results))
