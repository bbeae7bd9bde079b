#pragma once
// The grouped FP8 weight-gradient GEMM of jax_fp8_grouped_wgrad (grouped_wgrad_cuda.cc): a
// grouped GEMM ragged along its contraction, run as CUTLASS's SM90 ptr-array grouped GEMM
// (grouped_gemm_sm90.cuh's kernel, one configuration per operand and output type:
// grouped_wgrad_sm90_*.cu, built only for sm_90a and only where CUTLASS's headers were
// found: JAX_FP8_HAS_CUTLASS; else the table is empty and the custom call is never emitted).
//
// For each group g of consecutive token rows (sizes group_sizes [G], clamped in order to m
// rows as grouped_gemm.h clamps them):
//   out[g] [k, n] = alpha_g * sum over the group's rows r of lhs[r, :]^T grad[r, :],
//   alpha_g = lhs_scale_inv[g] * grad_scale_inv[g],
// every product of FP8 values exact, summed in float32 by the tensor cores (promoted into a
// float32 accumulator every 4 wgmma K-steps: 128 tokens), one float32 multiply by alpha_g and
// one rounding to the output type. An empty group's out[g] is alpha_g * 0.
//
// The operands come transposed and padded (jax_fp8/_primitives/grouped_wgrad.py builds them:
// a gather of rows in XLA, the bytes transposed by transpose_cuda.cu): lhs_t [k, mp] and
// grad_t [n, mp], the tokens contiguous (K-major, as FP8 wgmma reads both operands), group
// g's tokens in columns [pstart_g, pstart_g + size_g) with pstart_g = sum over h < g of
// ceil16(size_h) (16-column, i.e. 16-byte, boundaries: TMA), every other column 0.
// mp % 16 == 0 and m <= mp - 16 * (groups + 1), so the groups' columns end before the last
// 16 columns, which are 0: an empty group reads them (a contraction of 16 zeros), never a
// contraction of length 0. Each group's GEMM contracts over ceil16(size_g) columns (its
// tokens and the zero columns after them: the same sums, a contraction of 16-byte rows).
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_fp8 {

struct GroupedWgradCall {
  int64_t m;  // the rows the sizes are clamped to: m <= mp - 16 * (groups + 1)
  int64_t k, n, mp, groups;
  const void* lhs_t;            // [k, mp], tokens contiguous
  const void* grad_t;           // [n, mp], tokens contiguous
  const int32_t* group_sizes;   // [groups]
  const float* lhs_scale_inv;   // [groups]
  const float* grad_scale_inv;  // [groups]
  void* out;                    // [groups, k, n], N contiguous
  void* workspace;
  size_t workspace_bytes;
};

// A compiled configuration: its name, the types it computes (lhs E4M3), its entry points.
struct GroupedWgradConfig {
  const char* name;
  bool grad_e5m2;  // else E4M3
  bool out_bf16;   // else float32
  // Once per device before the first run (and before any stream capture). 0 or a cudaError_t.
  int (*prepare)(int32_t device);
  // Enqueues the setup kernel and the grouped GEMM; 0, a cudaError_t, or -1 when CUTLASS
  // cannot implement it / the workspace is short.
  int (*run)(const GroupedWgradCall& c, int32_t device, cudaStream_t stream);
};

int GroupedWgradConfigCount();
const GroupedWgradConfig& GroupedWgradConfigAt(int i);
// The configuration for these types, or -1 (none compiled).
int GroupedWgradFind(bool grad_e5m2, bool out_bf16);

}  // namespace jax_fp8
