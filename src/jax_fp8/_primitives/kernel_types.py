"""The element types the FFI kernels (ffi/) read and write, declared once for the Python side.

Each primitive's kernel predicate and each caller's check of the operands it may hand a
kernel reads these tuples; ffi/module.cc's handlers bind the same types (a type outside
them is refused there with an error, never converted).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

# The wide types the quantizing kernels read (ffi/transpose_cuda.cu, ffi/block_quantize_cuda.cu).
WIDE_INPUTS = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
# The FP8 types the quantizing kernels write (the OCP formats; not the fnuz variants).
FP8_OUTPUTS = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
# The result types the GEMM kernels write (ffi/block_gemm_cuda.cc, ffi/grouped_gemm_cuda.cc);
# a float16 result is written as float32 and rounded once by XLA.
GEMM_OUTPUTS = (np.dtype(jnp.bfloat16), np.dtype(np.float32))


def gemm_output(out_dtype: DTypeLike) -> np.dtype:
    """The type a GEMM kernel is asked to write for a result in `out_dtype`: float32 for a
    float16 result (rounded once after the custom call, as the reference rounds), else
    `out_dtype` itself (the kernels' limits take `GEMM_OUTPUTS`)."""
    out_dtype = np.dtype(out_dtype)
    return np.dtype(np.float32) if out_dtype == np.dtype(np.float16) else out_dtype
