"""FP8 matrix transposes: the byte-transpose kernel vs XLA's transpose vs a copy.

The kernel gradient of every FP8 GEMM transposes the quantized input and the quantized
gradient (cuBLASLt's FP8 GEMMs contract over minor axes only). This measures, per shape,
the GPU time (profiler trace, sum of kernel durations) of one transpose done by
`jax_fp8._transpose` (the CUDA kernel), by `lax.transpose` (XLA's kernel), and of an
elementwise pass over the same bytes (read + write: the floor), and prints a table with
the ratios. The shapes are those of the train step in bench_train_step.py (tokens x d,
d = 2048, 4096 tokens) plus two edge cases.

    python bench/bench_transpose.py [--reps 50] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_update  # noqa: E402  (profiler helpers)

from jax_fp8 import _transpose  # noqa: E402

SHAPES = [(4096, 2048), (4096, 6144), (4096, 8192), (8192, 4096), (2048, 2048),
          (4100, 2052), (16, 4096)]

VARIANTS = {
    "jax_fp8 kernel": _transpose.transpose_bytes_p.bind,
    "XLA transpose": lambda x: lax.transpose(x, (1, 0)),
    # The same bytes read and written once, elementwise in 32-bit words (the floor).
    "copy (floor)": lambda x: _words_xor(x),
}


def _words_xor(x):
    w = lax.bitcast_convert_type(x.reshape(x.shape[0], -1, 4), jnp.uint32)
    return lax.bitcast_convert_type(w ^ jnp.uint32(1), x.dtype).reshape(x.shape)


def measure(fn, x, reps, platform):
    # x donated and handed back: no copy of it (the table's "kernels" says what ran).
    step = jax.jit(lambda state: (state[0], fn(state[0])), donate_argnums=0)
    state = step((x, fn(x)))
    _, info = bench_update.traced_device_time(step, state, reps, platform)
    if "error" in info:
        raise RuntimeError(info["error"])
    return info["device_us"], info["events_per_call"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    args = p.parse_args(argv)
    platform = bench_update._platform()
    rows = []
    rng = np.random.default_rng(0)
    print(f"# FP8 transposes on {jax.devices()[0].device_kind} ({platform}), "
          f"jax {jax.__version__}, GPU time per transpose (µs)\n")
    print("| shape | bytes | " + " | ".join(VARIANTS) + " | kernel GB/s | XLA / kernel "
          "| kernel / copy | kernels per call |")
    print("|---|---|" + "---|" * (len(VARIANTS) + 4))
    shapes = [(128, 256), (132, 260)] if args.quick else SHAPES
    for shape in shapes:
        host = rng.integers(0, 256, shape, dtype=np.uint8)
        fp8 = host.view(np.dtype(jnp.float8_e4m3fn))
        got = np.asarray(_transpose.transpose_bytes_p.bind(jax.device_put(fp8)))
        np.testing.assert_array_equal(got.view(np.uint8), host.T)
        times = {}
        for name, fn in VARIANTS.items():  # (a fresh copy each: the step donates it)
            times[name] = measure(fn, jax.device_put(fp8), args.reps, platform)
        k, xla, cp = (times[n][0] for n in VARIANTS)
        nbytes = int(np.prod(shape))
        rows.append({"shape": list(shape), "bytes": nbytes,
                     **{n: {"us": t, "kernels": e} for n, (t, e) in times.items()}})
        print(f"| {shape[0]}x{shape[1]} | {nbytes / 2**20:.1f} MiB | "
              + " | ".join(f"{t:.2f}" for t, _ in times.values())
              + f" | {2 * nbytes / k / 1e3:.0f} | {xla / k:.2f} | {k / cp:.2f} | "
              + "/".join(f"{e:g}" for _, e in times.values()) + " |")
    # The gradient's quantize + transpose + amax: one kernel vs XLA's (quantize and amax
    # fused, the amax's second stage, the transpose).
    qt_rows = []
    print("\n# Quantize (E5M2, scale 0.5) + transpose + amax of a bf16 gradient, GPU time (µs)\n")
    print("| shape | jax_fp8 kernel | XLA ops | kernels (ours / XLA) | XLA / kernel |")
    print("|---|---|---|---|---|")
    qt_variants = {
        "kernel": lambda x: _transpose.quantize_transpose_p.bind(
            x, jnp.float32(0.5), fp8_dtype=np.dtype(jnp.float8_e5m2)),
        "xla": lambda x: _transpose._qt_reference(
            x, jnp.float32(0.5), fp8_dtype=np.dtype(jnp.float8_e5m2)),
    }
    for shape in [(128, 256)] if args.quick else [(4096, 2048), (4096, 6144), (4096, 8192)]:
        g = np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
        t = {n: measure(fn, jax.device_put(g), args.reps, platform)  # (donated: a copy each)
             for n, fn in qt_variants.items()}
        qt_rows.append({"shape": list(shape), **{n: {"us": u, "kernels": e}
                                                 for n, (u, e) in t.items()}})
        print(f"| {shape[0]}x{shape[1]} | {t['kernel'][0]:.2f} | {t['xla'][0]:.2f} | "
              f"{t['kernel'][1]:g} / {t['xla'][1]:g} | {t['xla'][0] / t['kernel'][0]:.2f} |")
    if args.json:
        with open(args.json, "w") as fp:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "rows": rows, "quantize_transpose": qt_rows}, fp, indent=1)


if __name__ == "__main__":
    main()
