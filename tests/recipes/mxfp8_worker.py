"""Multi-device checks of MXFP8, run with 8 host CPU devices.

test_mxfp8.py starts this file through helpers.run_8_device_worker; it runs every check and
prints "RESULTS <json>": {"check name": "ok" | "<traceback>"}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

# The test folders are on PYTHONPATH (helpers.run_8_device_worker puts them there).
import block_reference as ref
import helpers
import jax_fp8
from jax_fp8.devtools import hlo

RESULTS: dict[str, str] = {}
assert jax.device_count() == 8, jax.devices()
MESH = jax.make_mesh((8,), ("d",), devices=jax.devices(),
                     axis_types=(jax.sharding.AxisType.Auto,))
DENSE = (((1,), (0,)), ((), ()))
RNG = np.random.default_rng(0)
X = (RNG.normal(size=(256, 192)) * np.exp2(RNG.integers(-4, 5, (256, 1)))).astype(np.float32)
W = (RNG.normal(size=(192, 128)) * 0.05).astype(np.float32)
C = RNG.normal(size=(256, 128)).astype(np.float32)
META = jax_fp8.Fp8Meta.create(jax_fp8.MXFP8BlockScaling())
check = helpers.recorder(RESULTS)


def put(a, spec):
    return jax.device_put(a, NamedSharding(MESH, spec))


def step(x, w, c):
    def loss(x, w):
        return jnp.sum(jax_fp8.fp8_dot_general(x, w, DENSE, META)[0] * c)
    return jax.grad(loss, (0, 1))(x, w)


@check
def quantization_sharded_along_m_equals_the_reference_bits():
    f = jax.jit(jax_fp8.quantize_mxfp8)
    q, s = f(put(X, P("d")))
    rq, re = ref.quantize_mxfp8(X, np.dtype(jnp.float8_e4m3fn))
    assert np.array_equal(np.asarray(q).view(np.uint8), rq.view(np.uint8))
    assert np.array_equal(np.asarray(s).view(np.uint8), re)
    counts = hlo.count_collectives(f.lower(put(X, P("d"))).compile())
    assert not counts, f"the row-sharded quantization needs no collective, got {counts}"


@check
def data_parallel_step_equals_one_device_and_reduces_only_the_weight_gradient():
    one = jax.jit(step)(X, W, C)
    args = (put(X, P("d")), put(W, P()), put(C, P("d")))
    compiled = jax.jit(step).lower(*args).compile()
    got = compiled(*args)
    for g, o, what in zip(got, one, ("dx", "dw")):
        # The same FP8 operands; XLA's CPU dot may sum a sharded GEMM in its own order.
        np.testing.assert_allclose(np.asarray(g), np.asarray(o), rtol=2e-5, atol=1e-5,
                                   err_msg=what)
    counts = hlo.count_collectives(compiled)
    assert "all-gather" not in counts, counts      # x stays sharded: no copy of it
    assert counts.get("all-reduce", 0) >= 1, counts  # the weight gradient over the batch


print("RESULTS " + __import__("json").dumps(RESULTS))
