#pragma once
// The grouped FP8 GEMM of jax_fp8_grouped_gemm (grouped_gemm_cuda.cc): one configuration of
// CUTLASS's SM90 ptr-array grouped GEMM per operand and output type
// (grouped_gemm_sm90_*.cu, built only for sm_90a and only where CUTLASS's headers were
// found: JAX_FP8_HAS_CUTLASS; else the table is empty and the custom call is never emitted).
//
// out [m, n] = for each group g, rows [offset_g, offset_g + size_g) of
//   alpha_g * (lhs rows . rhs[g]^T), alpha_g = lhs_scale_inv[g] * rhs_scale_inv[g],
// every product of FP8 values exact, summed in float32 by the tensor cores (promoted into a
// float32 accumulator every 4 wgmma K-steps: 128 values of K), then one float32 multiply by
// alpha_g (itself one float32 product) and one rounding to the output type; rows from
// sum(sizes) to m are 0. Sizes are read on the device: size_g clamped to [0, m - offset_g],
// offset_g the sum of the clamped sizes before g (negative sizes count as 0; groups past m
// are cut at m), so no host synchronization and no access outside the buffers.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_fp8 {

struct GroupedGemmCall {
  int64_t m, n, k, groups;
  const void* lhs;             // [m, k], K contiguous
  const void* rhs;             // [groups, n, k], K contiguous
  const int32_t* group_sizes;  // [groups]
  const float* lhs_scale_inv;  // [groups]
  const float* rhs_scale_inv;  // [groups]
  void* out;                   // [m, n], N contiguous
  void* workspace;
  size_t workspace_bytes;
};

// A compiled configuration: its name, the types it computes, its entry points.
struct GroupedGemmConfig {
  const char* name;
  bool lhs_e5m2;  // else E4M3 (rhs is E4M3)
  bool out_bf16;  // else float32
  // Once per device before the first run (and before any stream capture): the kernel's
  // shared-memory attribute and the persistent grid's size. 0 or a cudaError_t.
  int (*prepare)(int32_t device);
  // Enqueues the setup kernel, the zeroing of the rows past the groups and the grouped
  // GEMM; 0, a cudaError_t, or -1 when CUTLASS cannot implement it / the workspace is short.
  int (*run)(const GroupedGemmCall& c, int32_t device, cudaStream_t stream);
};

int GroupedGemmConfigCount();
const GroupedGemmConfig& GroupedGemmConfigAt(int i);
// The configuration for these types, or -1 (none compiled).
int GroupedGemmFind(bool lhs_e5m2, bool out_bf16);

}  // namespace jax_fp8
