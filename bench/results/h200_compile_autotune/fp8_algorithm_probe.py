"""The 12 distinct FP8 GEMMs of the d = 2048, 4096-token train step in one jit, written with a
Precision (DEFAULT forward, HIGHEST gradients) or with the matching DotAlgorithmPreset
(ANY_F8_ANY_F8_F32_FAST_ACCUM / ANY_F8_ANY_F8_F32): cold compile time, what XLA:GPU ran,
the error against a float32 GEMM of the same FP8 values, and whether the two modes' outputs
are the same bits. One fresh process per mode, then the comparison:

    for m in precision algorithm; do JAX_ENABLE_COMPILATION_CACHE=false \
        python fp8_algorithm_probe.py $m >> fp8_algorithm_probe.jsonl; done
    python fp8_algorithm_probe.py compare >> fp8_algorithm_probe.jsonl
"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
from jax import lax
E4, E5, BF = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16
P = lax.Precision
A = lax.DotAlgorithmPreset
T = 4096
DENSE = [(2048, 6144), (2048, 2048), (2048, 8192), (8192, 2048)]
NT = (((1,), (1,)), ((), ()))
NN = (((1,), (0,)), ((), ()))

def specs():
    out = []
    for din, dout in DENSE:
        out.append(("fwd", (T, din, E4), (din, dout, E4), NN, "fast"))
        out.append(("dgrad", (T, dout, E5), (din, dout, E4), NT, "precise"))
        out.append(("wgrad", (din, T, E4), (dout, T, E5), NT, "precise"))
    return out

def prec(mode, kind):
    if mode == "precision":
        return None if kind == "fast" else P.HIGHEST
    return A.ANY_F8_ANY_F8_F32_FAST_ACCUM if kind == "fast" else A.ANY_F8_ANY_F8_F32

def step(mode, ops):
    outs = []
    for (name, a, b, dn, kind), (qa, qb, sa, sb) in zip(specs(), ops):
        o = lax.dot_general(qa, qb, dn, precision=prec(mode, kind), preferred_element_type=BF)
        outs.append(o * (sa * sb).astype(BF))
    return outs

def main(mode):
    key = jax.random.PRNGKey(0)
    ops = []
    for i, (name, a, b, dn, kind) in enumerate(specs()):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        qa = (jax.random.normal(k1, a[:2]) * 2).astype(a[2])
        qb = (jax.random.normal(k2, b[:2]) * 2).astype(b[2])
        ops.append((qa, qb, jnp.float32(0.5), jnp.float32(0.25)))
    fn = jax.jit(lambda ops: step(mode, ops))
    low = fn.lower(ops)
    t0 = time.perf_counter(); comp = low.compile(); compile_s = time.perf_counter() - t0
    txt = comp.as_text()
    calls = {}
    for ln in txt.splitlines():
        if 'custom_call_target="' in ln:
            t = ln.split('custom_call_target="')[1].split('"')[0]; calls[t] = calls.get(t, 0) + 1
    n_triton = txt.count("__triton_nested_gemm_fusion")
    outs = comp(ops); jax.block_until_ready(outs)
    t1 = time.perf_counter()
    for _ in range(10): outs = comp(ops)
    jax.block_until_ready(outs); wall_ms = (time.perf_counter() - t1) / 10 * 1e3
    ref = jax.jit(lambda ops: [lax.dot_general(qa.astype(jnp.float32), qb.astype(jnp.float32), dn,
                                               precision=P.HIGHEST) * (sa * sb)
                               for (name, a, b, dn, kind), (qa, qb, sa, sb) in zip(specs(), ops)])(ops)
    errs = [float(jnp.max(jnp.abs(o.astype(jnp.float32) - r)) / float(jnp.max(jnp.abs(r))))
            for o, r in zip(outs, ref)]
    np.savez(f"/tmp/alg_{mode}.npz", *[np.asarray(o.astype(jnp.float32)) for o in outs])
    print(json.dumps(dict(mode=mode, compile_s=compile_s, custom_calls=calls, triton_gemms=n_triton,
                          wall_ms=wall_ms, max_err_over_max=[f"{e:.2e}" for e in errs],
                          names=[s[0] for s in specs()])), flush=True)

if __name__ == "__main__":
    if sys.argv[1] == "compare":
        a, b = np.load("/tmp/alg_precision.npz"), np.load("/tmp/alg_algorithm.npz")
        print(json.dumps({"bitwise_equal": [bool(np.array_equal(a[k], b[k])) for k in a.files],
                          "max_abs_diff": [float(np.max(np.abs(a[k] - b[k]))) for k in a.files]}))
    else:
        main(sys.argv[1])
