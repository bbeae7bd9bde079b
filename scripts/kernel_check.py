"""Quick CUDA-vs-CPU kernel check and one GPU timing (run on a GPU machine).

Compares the CUDA kernel with the CPU kernel bit for bit on adversarial inputs
(NaN, inf, signed zeros, subnormals, huge), then times update_states on 1,152
per-tensor states of history 1024 from a profiler trace.

  python scripts/kernel_check.py [--trace-dir DIR]
"""

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bench_update  # noqa: E402  (profiler trace parsing)

SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 1e-40, -1e-42,
                     np.finfo(np.float32).max, 1e38, 448 / np.finfo(np.float32).max / 2,
                     3.5, 1.0, -2.0, 7e-3], np.float32)


def adversarial(rng, shape):
    x = np.asarray(np.abs(rng.standard_normal(shape)) * 10.0 ** rng.integers(-5, 5, shape),
                   np.float32).reshape(shape)
    mask = np.asarray(rng.random(shape) < 0.3).reshape(shape)
    x[mask] = rng.choice(SPECIALS, size=int(mask.sum()))
    return x.astype(np.float32)


def run_on(device, fn, *args):
    args = jax.device_put(args, device)
    return [np.asarray(o) for o in jax.tree.leaves(jax.jit(fn)(*args))]


def check_bits(gpu, cpu):
    """One update_states call per option combination, all shapes in it: few compiles."""
    checked = 0
    rng = np.random.default_rng(0)
    shapes = [lead + (L,) for L in (1, 2, 3, 16, 1023, 1024, 1025, 4096, 5000)
              for lead in ((), (7,), (2, 33))]
    for algo in ("max", "most_recent"):
        for p2 in (False, True):
            for skip in (False, True):
                for with_amax in (False, True):
                    tree, amaxes = [], []
                    for k, shape in enumerate(shapes):
                        h = adversarial(rng, shape)
                        if skip:
                            h[..., 0].flat[::2] = 0.0
                        tree.append(jax_fp8.ScalingState(
                            h, adversarial(rng, shape[:-1]), adversarial(rng, shape[:-1]),
                            jnp.float8_e5m2 if k % 2 else jnp.float8_e4m3fn))
                        amaxes.append(adversarial(rng, shape[:-1]))
                    recipe = jax_fp8.DelayedScaling(amax_compute_algo=algo, power_of_2_scale=p2,
                                                    skip_unused=skip, margin=0.5 if p2 else 0.0)
                    f = lambda t, a: jax_fp8.update_states(t, a, recipe=recipe)
                    a = amaxes if with_amax else None
                    og, oc = run_on(gpu, f, tree, a), run_on(cpu, f, tree, a)
                    for x, y in zip(og, oc):
                        if not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
                            bad = np.nonzero(x.view(np.uint32) != y.view(np.uint32))
                            print("MISMATCH", recipe, with_amax, x.shape, bad, x[bad][:5], y[bad][:5])
                            sys.exit(1)
                    checked += len(shapes)
    # 1,500 states of mixed shapes in one call: two launches past the parameter limit.
    tree = [jax_fp8.ScalingState(adversarial(rng, (i % 3, 17 * (i % 5) + 1)),
                                 adversarial(rng, (i % 3,)), np.ones((i % 3,), np.float32),
                                 jnp.float8_e5m2 if i % 2 else jnp.float8_e4m3fn)
            for i in range(1500)]
    amaxes = [adversarial(rng, (i % 3,)) for i in range(1500)]
    f = lambda t, a: jax_fp8.update_states(t, a)
    og, oc = run_on(gpu, f, tree, amaxes), run_on(cpu, f, tree, amaxes)
    assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(og, oc))
    checked += 1500
    print(f"bitwise CUDA == CPU on {checked} states")


def gpu_time(fn, state, reps, logdir, platform_name="gpu"):
    """(µs of kernels per call, kernels per call, {kernel name: count}) from a trace."""
    state = fn(state)
    jax.block_until_ready(state)
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(reps):
            state = fn(state)
        jax.block_until_ready(state)
    kernels = bench_update.traced_kernels(logdir, platform_name)
    return (sum(us for _, us in kernels.values()) / reps,
            sum(n for n, _ in kernels.values()) / reps,
            {name: n for name, (n, _) in kernels.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace-dir", default=tempfile.mkdtemp())
    ap.add_argument("--skip-bits", action="store_true",
                    help="only the timings (tests/ checks the bits too)")
    ap.add_argument("--scale", default="",
                    help="also time one call on this many per-tensor states, e.g. 5000,50000 "
                         "(bits against the IEEE reference, compile time reported)")
    ap.add_argument("--scale-groups", default="",
                    help="also update N tensors held as G stacked states in one call, "
                         "N:G[,N:G...], e.g. 50000:1400 (G past the 1,360 groups of one "
                         "launch); bits checked against tests/ieee_reference.py")
    ap.add_argument("--only-scale", action="store_true",
                    help="skip the standard timings (1,152 states etc.), run --scale and "
                         "--scale-groups only")
    args = ap.parse_args()
    gpu = jax.devices("gpu")[0]
    cpu = jax.devices("cpu")[0]
    print("jax", jax.__version__, gpu.device_kind, "cuda kernel:", jax_fp8.HAS_CUDA_KERNEL)
    if not args.skip_bits:
        t0 = time.time()
        check_bits(gpu, cpu)
        print(f"check took {time.time() - t0:.1f}s")
    configs = [] if args.only_scale else [(1152, 1024, False), (1152, 1024, True),
                                          (1152, 16, False), (3, 16, False), (1, 1, False)]
    configs += [(int(n), 16, False) for n in args.scale.split(",") if n]
    # First: a few seconds; the 5,000 separate states take minutes to compile.
    for spec in filter(None, args.scale_groups.split(",")):
        n, g = (int(v) for v in spec.split(":"))
        scale_groups(gpu, n, g, os.path.join(args.trace_dir, f"groups_{n}_{g}"))
    for n, L, stacked in configs:
        if stacked:
            tree = jax_fp8.ScalingState.create((n,), L)
        else:
            tree = [jax_fp8.ScalingState.create((), L) for _ in range(n)]
        tree = jax.device_put(tree, gpu)
        fn = jax.jit(lambda t: jax_fp8.update_states(t), donate_argnums=0)
        t0 = time.time()
        fn = fn.lower(tree).compile()
        print(f"  compile N={n} L={L} stacked={stacked}: {time.time() - t0:.1f}s")
        us, nk, names = gpu_time(fn, tree, 50, os.path.join(args.trace_dir, f"{n}_{L}_{stacked}"))
        print(f"N={n} L={L} stacked={stacked}: {us:.2f} us GPU, {nk:.1f} kernels/update {names}")
        if n >= 5000:  # past the parameter limit: several launches, one custom call
            calls = fn.as_text().count('custom_call_target="jax_fp8_update"')
            rng = np.random.default_rng(n)
            host = [(adversarial(rng, (L,)), adversarial(rng, ())) for _ in range(n)]
            tree = [jax_fp8.ScalingState(h, s, np.ones((), np.float32)) for h, s in host]
            out = fn(jax.device_put(tree, gpu))  # the compiled call timed above
            same = bits_equal_reference(host, out)
            print(f"  custom calls: {calls}, bitwise == IEEE reference: {same}")


def bits_equal_reference(host, out, dtypes=None):
    """Each updated state against SPEC.md's IEEE reference (numpy), bit for bit. (The
    CPU kernel would do too, but compiling thousands of operands on CPU takes long.)"""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import ieee_reference as ref
    same = True
    for i, ((h, s), st) in enumerate(zip(host, out)):
        dt = "float8_e4m3fn" if dtypes is None else jnp.dtype(dtypes[i]).name
        want = ref.update(h, s, fp8_dtype=dt)
        for got, w in zip((st.amax_history, st.scale, st.scale_inv), want):
            same &= np.array_equal(np.asarray(got).view(np.uint32), w.view(np.uint32))
    return bool(same)


def scale_groups(gpu, n, g, logdir, hist_len=16):
    """n tensors as g stacked states (sizes differ by at most one) in ONE update_states
    call: compile time, GPU time, launches, custom calls, and the bits against the IEEE
    reference of SPEC.md (numpy; the CPU kernel's compile of thousands of operands is
    what would take long, see README)."""
    rng = np.random.default_rng(n + g)
    sizes = [n // g + (i < n % g) for i in range(g)]
    host = [(adversarial(rng, (k, hist_len)), adversarial(rng, (k,)),
             jnp.float8_e5m2 if i % 2 else jnp.float8_e4m3fn) for i, k in enumerate(sizes)]
    tree = [jax_fp8.ScalingState(h, s, np.ones_like(s), dt) for h, s, dt in host]
    fn = jax.jit(jax_fp8.update_states)
    t0 = time.time()
    compiled = fn.lower(jax.device_put(tree, gpu)).compile()
    compile_s = time.time() - t0
    calls = compiled.as_text().count('custom_call_target="jax_fp8_update"')
    out = compiled(jax.device_put(tree, gpu))
    same = bits_equal_reference([(h, s) for h, s, _ in host], out, [dt for *_, dt in host])
    donated = jax.jit(jax_fp8.update_states, donate_argnums=0)
    us, nk, names = gpu_time(donated, jax.device_put(tree, gpu), 20, logdir)
    print(f"N={n} tensors in {g} stacked states, L={hist_len}: compile {compile_s:.1f}s, "
          f"{calls} custom call(s), {us:.2f} us GPU, {nk:.1f} kernels/update {names}, "
          f"bitwise == IEEE reference: {same}")


if __name__ == "__main__":
    main()
