#!/usr/bin/env python3
"""Benchmark: jax_fp8's FP8 layout kernels (the backward's transposes) against XLA's ops.

cuBLASLt's FP8 GEMMs contract over the minor axes only, so the kernel gradient of every
FP8 GEMM needs the quantized input and the quantized gradient transposed. jax_fp8 does
those with two CUDA kernels (jax_fp8._primitives.layout); this measures, per shape, the
device time of one call (profiler trace, the sum of the kernel durations over --reps
calls / reps, the input donated so nothing else runs):

  transpose   an FP8 [R, C] -> [C, R] by jax_fp8's byte-transpose kernel, by XLA's
              lax.transpose, and an elementwise pass over the same bytes in 32-bit words
              (read + write once: the floor)
  quantize    a bf16 gradient's quantize (E5M2) + transpose + amax: jax_fp8's one kernel
              against XLA's ops for the same values (quantize, transpose, amax)

The shapes are those of the train step of bench_train_step.py (tokens x d and its 3d,
4d) plus two edge cases. The bits are checked against lax.transpose on the way. On CPU
it runs (the kernels lower to XLA's ops there) but the times mean nothing.

    python bench/bench_layout_kernels.py [--reps 50] [--json OUT.json] [--quick]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import common
from jax_fp8._primitives import layout
from jax_fp8.devtools import trace

SHAPES = [(4096, 2048), (4096, 6144), (4096, 8192), (8192, 4096), (2048, 2048),
          (4100, 2052), (16, 4096)]
QT_SHAPES = [(4096, 2048), (4096, 6144), (4096, 8192)]
E5M2 = np.dtype(jnp.float8_e5m2)


def _words_xor(x):
    """The same bytes read and written once, elementwise in 32-bit words."""
    w = lax.bitcast_convert_type(x.reshape(x.shape[0], -1, 4), jnp.uint32)
    return lax.bitcast_convert_type(w ^ jnp.uint32(1), x.dtype).reshape(x.shape)


TRANSPOSES = {
    "jax_fp8 kernel": layout.transpose_bytes_p.bind,
    "XLA transpose": lambda x: lax.transpose(x, (1, 0)),
    "copy (floor)": _words_xor,
}
QUANTIZE = {
    "jax_fp8 kernel": lambda g: layout.quantize_transpose_p.bind(g, jnp.float32(0.5),
                                                                 fp8_dtype=E5M2),
    "XLA ops": lambda g: layout._qt_reference(g, jnp.float32(0.5), fp8_dtype=E5M2),
}


def device_us(fn, x, reps):
    """(µs per call, kernels per call) of fn(x), x donated and handed back each call."""
    step = jax.jit(lambda state: (state[0], fn(state[0])), donate_argnums=0)
    _, events = trace.capture(step, step((x, fn(x))), steps=reps)
    dev = trace.device_events(events)
    return trace.total_us(dev) / reps, len(dev) / reps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50, help="calls per trace (50)")
    p.add_argument("--json", default=None, help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="two small shapes (a smoke run)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    shapes = [(128, 256), (132, 260)] if args.quick else SHAPES
    qt_shapes = [(128, 256)] if args.quick else QT_SHAPES
    dev = jax.devices()[0]
    rows, qt_rows = [], []
    with common.Progress(len(shapes) + len(qt_shapes), "layout kernels") as progress:
        for shape in shapes:
            host = rng.integers(0, 256, shape, dtype=np.uint8)
            fp8 = host.view(np.dtype(jnp.float8_e4m3fn))
            got = np.asarray(layout.transpose_bytes_p.bind(jax.device_put(fp8)))
            np.testing.assert_array_equal(got.view(np.uint8), host.T)
            # A fresh copy for each: the step donates its input.
            times = {n: device_us(fn, jax.device_put(fp8), args.reps)
                     for n, fn in TRANSPOSES.items()}
            rows.append({"shape": list(shape), "bytes": int(np.prod(shape)),
                         **{n: {"us": t, "kernels": k} for n, (t, k) in times.items()}})
            progress.advance(f"transpose {shape[0]}x{shape[1]}: " + ", ".join(
                f"{n} {t:.2f} µs" for n, (t, _) in times.items()))
        for shape in qt_shapes:
            g = np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
            times = {n: device_us(fn, jax.device_put(g), args.reps) for n, fn in QUANTIZE.items()}
            qt_rows.append({"shape": list(shape),
                            **{n: {"us": t, "kernels": k} for n, (t, k) in times.items()}})
            progress.advance(f"quantize + transpose {shape[0]}x{shape[1]}: " + ", ".join(
                f"{n} {t:.2f} µs" for n, (t, _) in times.items()))
    kernel, xla, floor = TRANSPOSES
    print(f"# FP8 transposes on {dev.device_kind} ({common.platform_name()}), jax "
          f"{jax.__version__}: device time per call (µs)\n")
    print("| shape | MiB | " + " | ".join(TRANSPOSES) + " | kernel GB/s | XLA / kernel | "
          "kernel / copy | kernels per call |")
    print("|---|---:|" + "---:|" * (len(TRANSPOSES) + 4))
    for r in rows:
        k, x, c = (r[n]["us"] for n in TRANSPOSES)
        print(f"| {r['shape'][0]}x{r['shape'][1]} | {r['bytes'] / 2**20:.1f} | "
              + " | ".join(f"{r[n]['us']:.2f}" for n in TRANSPOSES)
              + f" | {2 * r['bytes'] / k / 1e3:.0f} | {x / k:.2f} | {k / c:.2f} | "
              + "/".join(f"{r[n]['kernels']:g}" for n in TRANSPOSES) + " |")
    print("\n# Quantize (E5M2, scale 0.5) + transpose + amax of a bf16 gradient: device "
          "time per call (µs)\n")
    print("| shape | jax_fp8 kernel | XLA ops | kernels (jax_fp8 / XLA) | XLA / kernel |")
    print("|---|---:|---:|---:|---:|")
    for r in qt_rows:
        k, x = r["jax_fp8 kernel"], r["XLA ops"]
        print(f"| {r['shape'][0]}x{r['shape'][1]} | {k['us']:.2f} | {x['us']:.2f} | "
              f"{k['kernels']:g} / {x['kernels']:g} | {x['us'] / k['us']:.2f} |")
    if args.json:
        common.write_json(args.json, {"device": dev.device_kind, "jax": jax.__version__,
                                      "transpose": rows, "quantize_transpose": qt_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
