#pragma once
// Transpose of byte-sized (FP8) matrices on the GPU: the layout change cuBLASLt's FP8
// GEMMs need for their gradient operands (both must contract over their minor axis).
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_fp8 {

// out[b, c, r] = in[b, r, c] for 1-byte elements; rows and cols must be multiples of 4
// (whole 32-bit words on both sides) and rows / 128 must fit a grid dimension.
cudaError_t LaunchTransposeBytes(cudaStream_t stream, const void* in, void* out,
                                 int64_t batch, int64_t rows, int64_t cols);

// Whether LaunchTransposeBytes takes these sizes (the Python side checks the same).
bool TransposeBytesSupports(int64_t batch, int64_t rows, int64_t cols);

}  // namespace jax_fp8
