"""jax_fp8.ragged_dot (the bf16 grouped GEMM) under a jit over 8 host devices, tokens
data-parallel, on meshes with Auto and with Explicit axes; run by test_ragged_dot_sharding.py.
Prints one JSON line: per mesh, whether the output and both gradients are one device's bits
(exact operands: every summation order gives them), the output's and gradients' shardings,
and the all-reduces of the compiled program."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_fp8
from jax_fp8.devtools import hlo

assert jax.device_count() == 8
M, K, N = 1024, 64, 32
SIZES = np.array([100, 0, 300, 50, 200, 124, 150, 60], np.int32)   # 40 rows past them
rng = np.random.default_rng(0)


def exact(shape):
    return (rng.integers(-3, 4, shape) * 2.0 ** rng.integers(-1, 2, shape)).astype(jnp.bfloat16)


x_np, w_np, ct_np = exact((M, K)), exact((len(SIZES), K, N)), exact((M, N))


def step(x, w, ct):
    out, vjp = jax.vjp(lambda x, w: jax_fp8.ragged_dot(x, w, SIZES), x, w)
    return (out, *vjp(ct))


want = [np.asarray(a) for a in jax.jit(step)(x_np, w_np, ct_np)]
results = {}
for name, axis_type in (("auto", AxisType.Auto), ("explicit", AxisType.Explicit)):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        x = jax.device_put(x_np, NamedSharding(mesh, P("data", None)))
        w = jax.device_put(w_np, NamedSharding(mesh, P()))
        ct = jax.device_put(ct_np, NamedSharding(mesh, P("data", None)))
        fn = jax.jit(step)
        got = fn(x, w, ct)
        text = fn.lower(x, w, ct).compile().as_text()
    kinds = {}
    for c in hlo.collectives(hlo.parse(text)):
        if c.opcode == "all-reduce":
            kinds[c.reduction] = kinds.get(c.reduction, 0) + 1
    # The weight gradient's bound where its per-device partial sums are rounded to bfloat16
    # before their sum (Explicit meshes: the transpose of the per-device product): each of
    # the 8 partial sums and each of the 7 additions rounds once, so
    # |got - exact| <= 2 * 8 * u_bf16 * S, S = sum over the group's rows of |x|^T |ct|.
    s = np.zeros(w_np.shape)
    start = 0
    for g, size in enumerate(SIZES):
        rows = slice(start, start + size)
        s[g] = np.abs(x_np[rows].astype(np.float64)).T @ np.abs(ct_np[rows].astype(np.float64))
        start += size
    err = np.abs(np.asarray(got[2], np.float64) - want[2].astype(np.float64))
    results[name] = {
        "same_bits": [bool(np.array_equal(np.asarray(a), b)) for a, b in zip(got, want)],
        "dw_within_bound": bool(np.all(err <= 2 * 8 * 2.0 ** -8 * s)),
        "shardings": [str(a.sharding.spec) for a in got],
        "all_reduces": kinds,
    }
print("RESULTS " + json.dumps(results))
