#pragma once
// The grouped weight-gradient GEMMs jax_fp8_grouped_wgrad's custom call takes
// (ffi/grouped_wgrad_cuda.cc): the one statement, exported by both modules as
// grouped_wgrad_supports (module.cc); it needs no CUDA. The workspace is the grouped GEMM's
// (grouped_gemm_workspace.h: the same per-group arrays).
//
// CUTLASS's per-group problem is (M, N, K) = (k, n, ceil16(size_g)): A = lhs_t's columns
// of the group (rows of mp bytes), B = grad_t's, D = out[g] [k, n]. TMA needs 16-byte row strides
// and starts: mp % 16 == 0 (the padded token axis; each group starts on a 16-column
// boundary) and output rows of 16-byte multiples (n % 8 == 0 for bf16, n % 4 == 0 for
// float32, so that out[g] = out + g * k * n is aligned too).
#include <cstdint>

#include "grouped_gemm_workspace.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// lhs_t [k, mp] of lhs_type, grad_t [n, mp] of grad_type into out [groups, k, n] of
// out_type: E4M3 lhs x E4M3 or E5M2 grad (the recipes' forward and gradient types), bf16
// or float32 out, 1 <= groups <= 2^20, k, n >= 1, mp % 16 == 0 and mp >= 16 * (groups + 1)
// (room for the last 16 zero columns), sizes that fit CUTLASS's int problem shapes.
inline bool GroupedWgradSupports(xla::ffi::DataType lhs_type, xla::ffi::DataType grad_type,
                                 xla::ffi::DataType out_type, int64_t k, int64_t n, int64_t mp,
                                 int64_t groups) {
  using xla::ffi::DataType;
  constexpr int64_t kIntMax = 2147483647;
  const bool types = lhs_type == DataType::F8E4M3FN &&
                     (grad_type == DataType::F8E4M3FN || grad_type == DataType::F8E5M2) &&
                     (out_type == DataType::BF16 || out_type == DataType::F32);
  const int64_t out_vec = out_type == DataType::BF16 ? 8 : 4;  // output elements in 16 bytes
  return types && groups > 0 && groups <= kGroupedGemmMaxGroups && k > 0 && k <= kIntMax && n > 0 &&
         n <= kIntMax && n % out_vec == 0 && mp <= kIntMax && mp % 16 == 0 &&
         mp >= 16 * (groups + 1);
}

}  // namespace jax_fp8
