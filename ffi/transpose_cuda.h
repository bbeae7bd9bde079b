#pragma once
// Transposes of byte-sized (FP8) matrices on the GPU: the layout change cuBLASLt's FP8
// GEMMs need for their gradient operands (both must contract over their minor axis).
#include <cstdint>

#include <cuda_runtime.h>

#include "element_types.h"

namespace jax_fp8 {

// Whether the kernels below take these sizes: rows and cols multiples of 4 (whole
// 32-bit words on both sides) and the tile grid within CUDA's limits. The Python side
// (jax_fp8/_primitives/layout.py) asks this very function (exported by the CUDA module)
// before it emits a call.
bool TransposeBytesSupports(int64_t batch, int64_t rows, int64_t cols);

// out[b, c, r] = in[b, r, c] for 1-byte elements.
cudaError_t LaunchTransposeBytes(cudaStream_t stream, const void* in, void* out, int64_t batch,
                                 int64_t rows, int64_t cols);

// For x [batch, rows, cols] of `in_type` and the float32 scale[batch], in one pass, for
// each matrix b of the batch:
//   q[b]   [rows, cols] = saturate_cast<fp8>(float32(x[b]) * scale[b])   (NaN stays NaN)
//   q_t[b] [cols, rows] = q[b] transposed
//   amax[b]             = max |x[b]| as float32 (NaN if any x[b] is NaN: the largest
//                         magnitude bits, as the bits of a non-negative float order)
// with exactly the bits of jax_fp8.quantize, lax.transpose and jnp.max(jnp.abs(x[b])).
// fp8_max: the FP8 type's largest finite value, from the caller (one source: Python).
cudaError_t LaunchQuantizeTranspose(cudaStream_t stream, InType in_type, Fp8Type fp8_type,
                                    const void* x, const float* scale, void* q, void* q_t,
                                    float* amax, int64_t batch, int64_t rows, int64_t cols,
                                    float fp8_max);

}  // namespace jax_fp8
