"""Multi-device checks of blockwise and current scaling, run with 8 host CPU devices.

test_scaled_dot.py starts this file through helpers.run_8_device_worker; it runs every
check, never stops at the first failure, and prints "RESULTS <json>":
{"check name": "ok" | "<traceback>"}. The sharded results are compared with the NumPy
oracle and the exact GEMM products, as the single-device tests compare one device's.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

# The test folders are on PYTHONPATH (helpers.run_8_device_worker puts them there).
import block_reference as ref
import gemm_bounds as tg
import helpers
import jax_fp8
from gemm_bounds import expected
from jax_fp8.gemm.scaled_dot import scaled_dot_general
from jax_fp8.quantization import blockwise

RESULTS: dict[str, str] = {}
assert jax.device_count() == 8, jax.devices()
MESH = jax.make_mesh((8,), ("d",), devices=jax.devices(),
                     axis_types=(jax.sharding.AxisType.Auto,))
ONE = jax.devices()[0]
DENSE = (((1,), (0,)), ((), ()))
RNG = np.random.default_rng(0)
X = (RNG.normal(size=(256, 384)) * np.exp2(RNG.integers(-4, 5, (256, 1)))).astype(np.float32)
W = (RNG.normal(size=(384, 128)) * 0.05).astype(np.float32)
C = RNG.normal(size=(256, 128)).astype(np.float32)
FP8 = jnp.float8_e4m3fn
RECIPES = {"block": jax_fp8.Float8BlockScaling(), "current": jax_fp8.Float8CurrentScaling()}
check = helpers.recorder(RESULTS)


def sharded(fn, args, specs):
    """fn jitted over the mesh, args placed with `specs`; results as NumPy."""
    placed = [jax.device_put(a, NamedSharding(MESH, s)) for a, s in zip(args, specs)]
    return jax.tree.map(np.asarray, jax.jit(fn)(*placed))


def _step(recipe):
    def loss(x, w, c):
        return jnp.sum(scaled_dot_general(x, w, DENSE, recipe) * c)
    return lambda x, w, c: (scaled_dot_general(x, w, DENSE, recipe),
                            jax.grad(loss, (0, 1))(x, w, c))


def _program(x_rows, x_cols, w_rep, c_rows, x_rep, w_cols, c_cols):
    quant = [(blockwise.quantize_blocks_both(x, (1, 128)),
              blockwise.quantize_blocks_both(x, (128, 128)), blockwise.quantize_current(x))
             for x in (x_rows, x_cols)]
    steps = {name: (_step(r)(x_rows, w_rep, c_rows), _step(r)(x_rep, w_cols, c_cols))
             for name, r in RECIPES.items()}
    return quant, steps


SPECS = [P("d"), P(None, "d"), P(), P("d"), P(), P(None, "d"), P(None, "d")]
QUANT, STEPS = sharded(_program, [X, X, W, C, X, W, C], SPECS)


def _same_as_oracle(got, x, block):
    for (q, s), (rq, rs) in zip((got[:2], got[2:]), (ref.quantize_blocks(x, block, FP8),
                                                     ref.quantize_blocks(x.T, block, FP8))):
        assert np.array_equal(q.view(np.uint8), rq.view(np.uint8)), block
        assert np.array_equal(s.view(np.uint32), rs.view(np.uint32)), block


@check
def quantization_equals_single_device_bits():
    """x sharded along M or along K: the FP8 data and scales of both block shapes and of
    current scaling (whose amax is a max over all devices) are the oracle's bits, which
    are one device's (tests/recipes/test_blockwise.py)."""
    for row, tile, (q, s) in QUANT:
        _same_as_oracle(row, X, (1, 128))
        _same_as_oracle(tile, X, (128, 128))
        rq, rs = ref.quantize_current(X, FP8)
        assert np.array_equal(q.view(np.uint8), rq.view(np.uint8)) and s == rs, "current"
    hlo = jax.jit(blockwise.quantize_current).lower(
        jax.device_put(X, NamedSharding(MESH, P("d")))).compile().as_text()
    assert "all-reduce" in hlo, "the amax is reduced over the devices"


@check
def data_and_tensor_parallel_steps_within_bounds():
    """Data parallel (x, cotangent along M) and tensor parallel (w, cotangent along N):
    forward, dgrad and wgrad within the single-device GEMM bounds of the exact products
    (XLA's CPU dot sums a sharded GEMM in its own order, so bits may differ from one
    device's; the FP8 operands are the same, see the check above)."""
    for name, recipe in RECIPES.items():
        e_s = expected(recipe, X, W, C)
        for layout, (out, (dx, dw)) in zip(("data parallel", "tensor parallel"), STEPS[name]):
            for got, (e, s), k, what in zip((out, dx, dw), e_s, (384, 128, 256),
                                            ("forward", "dgrad", "wgrad")):
                coef = tg.reference_coef(k) + 2 * tg.U
                tg.assert_within(got, e, s, coef, np.float32, f"{name} {layout} {what}")


print("RESULTS " + json.dumps(RESULTS))
