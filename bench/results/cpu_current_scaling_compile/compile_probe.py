"""Where the current-scaling train step's compile time goes, on the CPU: the step of
bench_train_step.py compiled (--compile-only) with one part of the quantization swapped
for plain XLA arithmetic. The swaps change the numbers, so this measures compile time only.

  python bench/results/cpu_current_scaling_compile/compile_probe.py MODE [SIZE]

MODE: base (as the library is); delayed (the delayed-scaling step, for reference);
plain_cast (block_quantize.cast_scaled -> clip(x * scale).astype); barrier (the scale
and its inverse behind lax.optimization_barrier); plain_divide (block_quantize.divide_rn,
the correctly rounded float32 division in integers, -> a / b); plain_inverse
(block_quantize.scale_inverse -> 1 / scale); plain_scale (the scale fp8_max / amax and its
inverse in plain arithmetic); f64_divide (divide_rn as one float64 division, rounded
to float32: correctly rounded, since float64 has more than 2 * 24 + 2 bits, and the
same bits as divide_rn on the CPU; a prototype defined here, not run on a GPU);
check_f64_divide (that prototype and divide_rn against NumPy's float64 division rounded to
float32, on 200,000 random pairs of normal float32 values). Prints one JSON line.
"""
import json
import os
import runpy
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax.extend.mlir import ir  # noqa: E402
from jax.extend.mlir.dialects import stablehlo as hlo  # noqa: E402
from jax.extend.core import Primitive  # noqa: E402
from jax.interpreters import batching, mlir  # noqa: E402

from jax_fp8 import recipe as recipe_lib  # noqa: E402
from jax_fp8._primitives import block_quantize as bq  # noqa: E402

def divide_in_f64(a, b):
    """a / b for float32 a, b as one float64 division rounded to float32, emitted in the
    lowering (JAX without x64 has no float64 arrays). Shapes: a, b [...] -> [...]."""
    return _divide_p.bind(*jnp.broadcast_arrays(jnp.asarray(a, jnp.float32),
                                                jnp.asarray(b, jnp.float32)))


def _divide_lowering(ctx, a, b):
    (aval,) = ctx.avals_out
    f64 = ir.RankedTensorType.get(aval.shape, ir.F64Type.get())
    q = hlo.divide(hlo.convert(f64, a), hlo.convert(f64, b))
    return [hlo.convert(ir.RankedTensorType.get(aval.shape, ir.F32Type.get()), q)]


_divide_p = Primitive("f32_divide_in_f64")
_divide_p.def_abstract_eval(lambda a, b: a)
mlir.register_lowering(_divide_p, _divide_lowering)
batching.defvectorized(_divide_p)


mode = sys.argv[1]
size = sys.argv[2] if len(sys.argv) > 2 else "128x24x128"
variant = "jax_fp8" if mode == "delayed" else "jax_fp8_current"
if mode == "plain_cast":
    def _plain_cast(x32, scale, fp8_dtype):
        fmax = np.float32(recipe_lib.fp8_max(fp8_dtype))
        return jnp.clip(x32 * scale, -fmax, fmax).astype(fp8_dtype)
    bq.cast_scaled = _plain_cast
elif mode == "barrier":
    _scale, _inverse = bq.scale_from_amax_f32, bq.scale_inverse
    bq.scale_from_amax_f32 = lambda *a: jax.lax.optimization_barrier(_scale(*a))
    bq.scale_inverse = lambda s: jax.lax.optimization_barrier(_inverse(s))
elif mode == "plain_divide":
    bq.divide_rn = lambda a, b: a / b
elif mode == "plain_inverse":
    bq.scale_inverse = lambda s: 1.0 / s
elif mode == "plain_scale":
    bq.scale_from_amax_f32 = lambda amax, fmax, eps, p2: jnp.where(
        amax > 0, np.float32(fmax) / jnp.maximum(amax, eps), np.float32(1.0))
    bq.scale_inverse = lambda s: 1.0 / s
elif mode == "f64_divide":
    bq.divide_rn = divide_in_f64
elif mode == "check_f64_divide":
    rng = np.random.default_rng(0)
    n = 200_000
    num = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    den = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    want = (num.astype(np.float64) / den.astype(np.float64)).astype(np.float32).view(np.uint32)
    got = np.asarray(jax.jit(divide_in_f64)(num, den)).view(np.uint32)
    ref = np.asarray(jax.jit(bq.divide_rn)(num, den)).view(np.uint32)
    print(json.dumps({"mode": mode, "pairs": n, "f64_equals_numpy": bool((got == want).all()),
                      "divide_rn_equals_numpy": bool((ref == want).all())}))
    raise SystemExit(0)
elif mode not in ("base", "delayed"):
    raise SystemExit(f"unknown mode {mode!r}")

out = tempfile.mkdtemp()
sys.argv = ["bench_train_step.py", "--sizes", size, "--variants", variant, "--compile-only",
            "--outdir", out]
try:
    runpy.run_path(os.path.join(ROOT, "bench", "bench_train_step.py"), run_name="__main__")
except SystemExit as e:
    if e.code not in (0, None):
        raise
(r,) = json.load(open(os.path.join(out, "results.json")))["results"]
print(json.dumps({"mode": mode, "size": size, "variant": variant,
                  "compile_s": round(r["compile_s"], 1), "jax": jax.__version__}))
