"""fp8_dot_general trained data-parallel on a mesh with Explicit axes (jax.make_mesh's
default), 8 host devices; run by test_explicit_mesh.py. Prints one JSON line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_fp8

assert jax.device_count() == 8
mesh = jax.make_mesh((8,), ("data",))
rng = np.random.default_rng(0)
x_np = rng.standard_normal((64, 32)).astype(np.float32)
w_np = (rng.standard_normal((32, 16)) * 0.1).astype(np.float32)
meta = jax_fp8.Fp8Meta.create()
dn = (((1,), (0,)), ((), ()))


def loss(w, x, meta):
    out, _ = jax_fp8.fp8_dot_general(x, w, dn, meta)
    return (out.astype(jnp.float32) ** 2).sum()


grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
want = jax.tree.map(np.asarray, grad(w_np, x_np, meta))
with jax.set_mesh(mesh):
    x = jax.device_put(x_np, NamedSharding(mesh, P("data", None)))
    w = jax.device_put(w_np, NamedSharding(mesh, P()))
    got = grad(w, x, meta)
    specs = [str(jax.typeof(got[0]).sharding.spec), str(jax.typeof(got[1]).sharding.spec)]
got = jax.tree.map(np.asarray, got)
equal = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
print("RESULTS " + json.dumps({"equal": equal, "specs": specs}))
