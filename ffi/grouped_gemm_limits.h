#pragma once
// The grouped FP8 GEMMs jax_fp8_grouped_gemm's custom call takes (ffi/grouped_gemm_cuda.cc)
// and the workspace it needs: the one statement of both, exported by both modules as
// grouped_gemm_supports / grouped_gemm_workspace_bytes (module.cc); it needs no CUDA.
//
// The kernel is CUTLASS's SM90 ptr-array grouped GEMM with TMA loads and stores, so every
// group's operand rows must start on a 16-byte boundary and every row be a multiple of 16
// bytes: K % 16 == 0 (FP8 rows of lhs and rhs, K-major), N % 8 == 0 for a bf16 output and
// N % 4 == 0 for a float32 output (output rows of 16-byte multiples, so that group g's
// first output row, at row offset_g, is aligned whatever offset_g is). The buffers XLA
// passes are at least 16-byte aligned; the handler checks it.
#include <cstdint>

#include "grouped_gemm_workspace.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// lhs [m, k] of lhs_type, rhs [groups, n, k] of rhs_type, into out [m, n] of out_type: the
// operand pairs compiled (E4M3 x E4M3 for the forward GEMM, E5M2 x E4M3 for the data
// gradient's), bf16 or float32 out, sizes that fit CUTLASS's int problem shapes, and the
// alignments above. Empty results (m or n 0) are taken (the call writes nothing).
inline bool GroupedGemmSupports(xla::ffi::DataType lhs_type, xla::ffi::DataType rhs_type,
                                xla::ffi::DataType out_type, int64_t m, int64_t n, int64_t k,
                                int64_t groups) {
  using xla::ffi::DataType;
  constexpr int64_t kIntMax = 2147483647;
  const bool types = (lhs_type == DataType::F8E4M3FN || lhs_type == DataType::F8E5M2) &&
                     rhs_type == DataType::F8E4M3FN &&
                     (out_type == DataType::BF16 || out_type == DataType::F32);
  const int64_t out_vec = out_type == DataType::BF16 ? 8 : 4;  // output elements in 16 bytes
  return types && groups > 0 && groups <= kGroupedGemmMaxGroups && m >= 0 && m <= kIntMax &&
         n >= 0 && n <= kIntMax && k > 0 && k <= kIntMax && k % 16 == 0 && n % out_vec == 0;
}

}  // namespace jax_fp8
