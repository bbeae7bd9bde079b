#pragma once
// Splitting one float32 array into consecutive pieces, each a buffer of its own, in one
// launch: how a packed FP8 state hands each layer its scales (see split_cuda.cu).
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_fp8 {

// dsts[k][j] = src[start_k + j] for j < counts[k], start_k = counts[0] + ... + counts[k-1].
// Enqueues only (no allocation, no synchronisation), so it is safe inside CUDA graph
// capture. The total count must be below 2^32 (checked; message in *why).
cudaError_t LaunchSplitRows(cudaStream_t stream, const float* src, float* const* dsts,
                            const int64_t* counts, size_t num_pieces, const char** why);

}  // namespace jax_fp8
