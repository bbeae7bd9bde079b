"""fp8_dot_general trained data-parallel on a mesh with Explicit axes (jax.make_mesh's
default), 8 host devices, for every recipe; run by test_explicit_mesh.py. Prints one
JSON line: per recipe and size, whether each sharded gradient equals one device's (and
the kernel gradient's distance from it over its bound), the specs of the kernel and
input gradients, or the error raised."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fp8

assert jax.device_count() == 8
mesh = jax.make_mesh((8,), ("data",))
rng = np.random.default_rng(0)
dn = (((1,), (0,)), ((), ()))
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.Float8CurrentScaling(),
           "block": jax_fp8.Float8BlockScaling(), "mxfp8": jax_fp8.MXFP8BlockScaling()}
# The example sizes, and sizes with whole 128-blocks per device.
SIZES = {"small": (64, 32, 16), "blocks": (1024, 256, 128)}


def loss(w, x, meta):
    out, _ = jax_fp8.fp8_dot_general(x, w, dn, meta)
    return (out.astype(jnp.float32) ** 2).sum()


def run(recipe, size):
    m, k, n = SIZES[size]
    x_np = rng.standard_normal((m, k)).astype(np.float32)
    w_np = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    meta = jax_fp8.Fp8Meta.create(RECIPES[recipe])
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    want = jax.tree.map(np.asarray, grad(w_np, x_np, meta))
    try:
        with jax.set_mesh(mesh):
            x = jax.device_put(x_np, NamedSharding(mesh, P("data", None)))
            w = jax.device_put(w_np, NamedSharding(mesh, P()))
            got = grad(w, x, meta)
            specs = [str(jax.typeof(got[0]).sharding.spec),
                     str(jax.typeof(got[1]).sharding.spec)]
    except Exception as e:  # noqa: BLE001 (reported to the test, which judges it)
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    got = jax.tree.map(np.asarray, got)
    # dw sums over the sharded rows: per device, then across devices, in another order
    # than one device's sum. Each order is within gamma_M * S of the exact sum of the
    # FP8 products (S: their absolute values, bounded with x's and g's quantization,
    # 2**-4 and 2**-3 relative, from the unquantized |x|^T |g|), so they differ by at
    # most twice that.
    g = 2 * (x_np.astype(np.float64) @ w_np.astype(np.float64))
    s = (np.abs(x_np).T.astype(np.float64) @ np.abs(g)) * (1 + 2.0**-4) * (1 + 2.0**-3)
    gamma = m * 2.0**-24 / (1 - m * 2.0**-24)
    dw_err = float(np.max(np.abs(got[0].astype(np.float64) - want[0]) / (2 * gamma * s + 1e-30)))
    return {"dw_equal": bool(np.array_equal(got[0], want[0])),
            "dx_equal": bool(np.array_equal(got[1], want[1])),
            "meta_equal": all(np.array_equal(a, b) for a, b in
                              zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]))),
            "dw_err_over_bound": dw_err, "specs": specs}


names = sys.argv[1:] or sorted(RECIPES)
print("RESULTS " + json.dumps({f"{r}/{s}": run(r, s) for r in names for s in SIZES}))
