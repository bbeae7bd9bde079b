#pragma once
// The 16-bit grouped GEMMs jax_fp8_ragged_dot's custom call takes (ffi/ragged_dot_cuda.cc):
// the one statement, exported by both modules as ragged_dot_supports (module.cc); it needs
// no CUDA. The workspace is the grouped FP8 GEMM's (grouped_gemm_workspace.h: the same
// per-group arrays).
//
// TMA needs every group's operand and output rows to start on 16-byte boundaries and 16-byte
// row strides; a group starts at any row, so every row of every operand and of the output is
// a multiple of 16 bytes: k % 8 == 0 and n % 8 == 0 for 16-bit operands (and so for a
// float32 output too).
#include <cstdint>

#include "grouped_gemm_workspace.h"
#include "ragged_dot_mode.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// The shapes of RaggedDotMode `mode` (ragged_dot.h) with both operands of `in_type` (bf16)
// and out of `out_type` (in_type, or float32 for kRaggedWeightGrad), 1 <= groups <= 2^20, k, n >=
// 1, m >= 0, sizes that fit CUTLASS's int problem shapes, and the alignments above.
inline bool RaggedDotSupports(int mode, xla::ffi::DataType in_type, xla::ffi::DataType out_type,
                              int64_t m, int64_t k, int64_t n, int64_t groups) {
  using xla::ffi::DataType;
  constexpr int64_t kIntMax = 2147483647;
  const bool types =
      in_type == DataType::BF16 &&
      (out_type == in_type || (mode == kRaggedWeightGrad && out_type == DataType::F32));
  const bool modes =
      mode == kRaggedForward || mode == kRaggedTransposed || mode == kRaggedWeightGrad;
  return types && modes && groups > 0 && groups <= kGroupedGemmMaxGroups && m >= 0 &&
         m <= kIntMax && k > 0 && k <= kIntMax && n > 0 && n <= kIntMax && k % 8 == 0 && n % 8 == 0;
}

}  // namespace jax_fp8
