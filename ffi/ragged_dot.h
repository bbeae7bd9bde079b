#pragma once
// The grouped GEMM of 16-bit operands of jax_fp8_ragged_dot (ragged_dot_cuda.cc):
// jax.lax.ragged_dot and the two products of its gradients, each one configuration of
// CUTLASS's SM90 ptr-array grouped GEMM per product and type (ragged_dot_sm90_*.cu, built
// only for sm_90a and only where CUTLASS's headers were found: JAX_FP8_HAS_CUTLASS; else the
// table is empty and the custom call is never emitted).
//
// Groups are consecutive rows of the token axis m, sizes read on the device and clamped in
// order as grouped_gemm.h clamps them (size_g to [0, m - offset_g], offset_g the sum of the
// clamped sizes before g). Every product of two 16-bit values is exact in float32 and summed
// in float32 by the tensor cores; one rounding to the output type. The three products:
//   kForward    lhs [m, k] . rhs [g, k, n] -> out [m, n]: rows of group g times rhs[g];
//   kTransposed lhs [m, k] . rhs [g, n, k] -> out [m, n]: rows of group g times rhs[g]^T
//               (the input gradient: the output gradient times the weights, transposed);
//   kWeightGrad lhs [m, k] , rhs [m, n]    -> out [g, k, n]: the sum over group g's rows r of
//               lhs[r, :]^T rhs[r, :] (the weight gradient: ragged along the contraction).
// Rows of out past the groups (kForward, kTransposed) are 0, and so is out[g] of an empty
// group (kWeightGrad).
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "ragged_dot_mode.h"

namespace jax_fp8 {

struct RaggedDotCall {
  int64_t m, k, n, groups;  // the shapes of the mode's comment above
  const void* lhs;
  const void* rhs;
  const int32_t* group_sizes;  // [groups]
  void* out;
  void* workspace;
  size_t workspace_bytes;
};

// A compiled configuration: its name, the product and types it computes, its entry points.
struct RaggedDotConfig {
  const char* name;
  int mode;        // RaggedDotMode
  bool in_f16;     // operands float16, else bfloat16
  bool out_float;  // float32 out, else the operands' type
  // Once per device before the first run (and before any stream capture). 0 or a cudaError_t.
  int (*prepare)(int32_t device);
  // Enqueues the setup kernel, the zeroing and the grouped GEMM; 0, a cudaError_t, or -1
  // when CUTLASS cannot implement it / the workspace is short.
  int (*run)(const RaggedDotCall& c, int32_t device, cudaStream_t stream);
};

int RaggedDotConfigCount();
const RaggedDotConfig& RaggedDotConfigAt(int i);
// The configuration for this product and these types, or -1 (none compiled).
int RaggedDotFind(int mode, bool in_f16, bool out_float);

}  // namespace jax_fp8
