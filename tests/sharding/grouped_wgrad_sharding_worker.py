"""The grouped weight-gradient primitive under a jit over 8 host devices, run by
test_grouped_wgrad_sharding.py: rows of lhs and grad sharded over the devices (tokens
data-parallel), the kernel asked for (implementation="cuda": on the CPU each device runs the
reference on its rows) and off. Prints one JSON line: per case, whether the result is the
one-device result's bits (exact operands: every float32 summation order is exact), how many
per-device computations and float32 all-reduces the compiled program holds, and explain's
row."""

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_fp8._primitives import base, grouped_wgrad as gw
from jax_fp8.devtools import explain, hlo

assert jax.device_count() == 8
M, K, N = 1024, 64, 32
# uneven, empty, a group across device boundaries (128 rows each), 40 rows past the groups
SIZES = np.array([100, 0, 300, 50, 200, 124, 150, 60], np.int32)
G = len(SIZES)
rng = np.random.default_rng(0)
lhs = rng.integers(-3, 4, (M, K)).astype(np.dtype(jnp.float8_e4m3fn))
grad = rng.integers(-3, 4, (M, N)).astype(np.dtype(jnp.float8_e5m2))
ls = (2.0 ** rng.integers(-4, 5, G)).astype(np.float32)
gs = (2.0 ** rng.integers(-4, 5, G)).astype(np.float32)
ls[1] = np.inf      # an empty group with an infinite scale: 0 * inf = NaN, as on one device

mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("data", None))
rep = NamedSharding(mesh, P())
args = (jax.device_put(lhs, rows), jax.device_put(grad, rows), jax.device_put(SIZES, rep),
        jax.device_put(ls, rep), jax.device_put(gs, rep))
one = [jax.device_put(a, jax.devices()[0]) for a in (lhs, grad, SIZES, ls, gs)]

results = {}
for impl in ("cuda", "jnp", "auto"):
    for out_dtype in (jnp.bfloat16, jnp.float32):
        fn = jax.jit(lambda *a: gw.grouped_wgrad(*a, out_dtype=out_dtype,  # noqa: B023
                                                 implementation=impl))  # noqa: B023
        want = np.asarray(jax.jit(lambda *a: gw.grouped_wgrad(  # noqa: B023
            *a, out_dtype=out_dtype, implementation="jnp"))(*one))
        got = fn(*args)
        compiled = fn.lower(*args).compile()
        text = compiled.as_text()
        (row,) = [r for r in explain.explain(
            lambda *a: gw.grouped_wgrad(*a, out_dtype=out_dtype,  # noqa: B023
                                        implementation=impl), *args)  # noqa: B023
            if r.name == gw.TARGET]
        results[f"{impl}_{np.dtype(out_dtype).name}"] = {
            "same_bits": bool(np.array_equal(np.asarray(got).view(np.uint8),
                                             want.view(np.uint8))),
            "nan_in_empty_group": bool(np.isnan(np.asarray(got, np.float32)[1]).all()),
            "replicated": got.sharding.is_fully_replicated,
            "per_device": text.count(base.per_device_scope(gw.TARGET)),
            "all_reduces": [[c.reduction, ",".join(c.dtypes)] for c in hlo.collectives(compiled)
                            if c.opcode == "all-reduce"],
            "row": [row.lowering, row.why],
        }
print("RESULTS " + json.dumps(results))
