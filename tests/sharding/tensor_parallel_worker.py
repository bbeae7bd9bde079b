"""A tensor-parallel (argument "tp") or FSDP ("fsdp") FP8 train step on a (data 4 x
model 2) mesh of 8 host devices; run by test_tensor_parallel.py. Prints one JSON line:
all-reduces by kind, the jax_fp8_update count, and whether the new FP8 state equals
the same step's on one device."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8
from jax_fp8.devtools.hlo import all_reduce_kinds

MODE = sys.argv[1] if len(sys.argv) > 1 else "tp"
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
DN = (((1,), (0,)), ((), ()))
LAYERS, D = 8, 64
recipe = jax_fp8.DelayedScaling(history_len=16)
rng = np.random.default_rng(0)
if MODE == "tp":  # Megatron-style: column-parallel then row-parallel weights
    specs = [P(None, "model") if i % 2 == 0 else P("model", None) for i in range(LAYERS)]
else:  # "fsdp": every weight's rows sharded over all 8 devices, gathered for the GEMM
    specs = [P(("data", "model"), None)] * LAYERS
ws = [jax.device_put((rng.random((D, D)) / 8).astype(np.float32), NamedSharding(mesh, spec))
      for spec in specs]
fp8 = jax.device_put([jax_fp8.Fp8Meta.create(recipe) for _ in range(LAYERS)],
                     NamedSharding(mesh, P()))
x = jax.device_put(rng.random((128, D)).astype(np.float32), NamedSharding(mesh, P("data", None)))


def loss(ws, fp8, x):
    h = x
    for w, m in zip(ws, fp8):
        h, _ = jax_fp8.fp8_dot_general(h, w, DN, m)
        h = jax.nn.gelu(h)
    return jnp.mean(h ** 2)


def step(ws, fp8, x):
    g, fg = jax.grad(loss, argnums=(0, 1))(ws, fp8, x)
    return [w - 0.1 * gw for w, gw in zip(ws, g)], jax_fp8.new_fp8_state(fp8, fg, recipe)


compiled = jax.jit(step).lower(ws, fp8, x).compile()
hlo = compiled.as_text()
_, new_fp8 = compiled(ws, fp8, x)
# The same step on one device: the amaxes (so the new scales and histories) must be the
# global ones, bit for bit.
one = jax.devices()[0]
_, want_fp8 = jax.jit(step)(*jax.device_put((ws, fp8, x), one))
same = all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
           for a, b in zip(jax.tree.leaves(new_fp8), jax.tree.leaves(want_fp8)))
staged = [float(np.asarray(st.amax_history)[-1])
          for m in new_fp8 for st in (m.input, m.kernel, m.grad)]
print("RESULTS " + json.dumps({"all_reduces": all_reduce_kinds(hlo),
                               "updates": hlo.count('custom_call_target="jax_fp8_update"'),
                               "fp8_state_equals_one_device": bool(same),
                               "amaxes_nonzero": all(v > 0 for v in staged)}))
