// The CUDA side of the fused update: a launcher that updates any number of tensor
// groups with one kernel launch per chunk of groups (see update_cuda.cu), and the
// XLA FFI handler that calls it.
#pragma once

#include <cuda_runtime_api.h>
#include <cstddef>

#include "scaling_math.h"
#include "tensor_group.h"

namespace jax_fp8 {

// Groups one launch can describe in its kernel parameters (CUDA >= 12.1 allows
// 32,764 bytes of them); past that, or past the other limits checked in
// PlanLaunches, the update takes one launch per chunk.
constexpr int kMaxGroupsPerLaunch = 1020;

// Launches the update of `groups` on `stream`; enqueues only (no allocation, no
// synchronisation), so it is safe inside CUDA graph capture. Returns the first
// CUDA error, or an error for inputs no launch can describe (message in *why).
cudaError_t LaunchUpdate(cudaStream_t stream, const TensorGroup* groups, size_t num_groups,
                         const UpdateOptions& opt, const char** why);

}  // namespace jax_fp8
