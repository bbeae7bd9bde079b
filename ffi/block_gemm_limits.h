#pragma once
// The GEMMs cuBLASLt's block-scaled FP8 matmul takes on Hopper (cuBLAS >= 12.9, scale modes
// VEC128_32F and BLK128x128_32F): jax_fp8_block_gemm's custom call is emitted for these
// (elsewhere the jax.numpy reference runs), so this is the one statement of its limits.
// Both modules export it as block_gemm_supports (module.cc); it needs no CUDA.
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// a [batch..., m, k] and b [batch..., n, k] of element types a_type and b_type, with 128 x 128
// scale tiles where a_tile / b_tile (else 1 x 128 blocks), into a result of out_type (the
// custom call's: a float16 result is written as float32 and converted by XLA).
inline bool BlockGemmSupports(xla::ffi::DataType a_type, xla::ffi::DataType b_type,
                              xla::ffi::DataType out_type, bool a_tile, bool b_tile, int64_t batch,
                              int64_t m, int64_t n, int64_t k) {
  using xla::ffi::DataType;
  const auto fp8 = [](DataType t) { return t == DataType::F8E4M3FN || t == DataType::F8E5M2; };
  return fp8(a_type) && fp8(b_type) &&
         !(a_type == DataType::F8E5M2 && b_type == DataType::F8E5M2) &&  // no E5M2 x E5M2
         !(a_tile && b_tile) &&  // at most one operand in 128 x 128 tiles
         (out_type == DataType::BF16 || out_type == DataType::F32) && batch > 0 && m > 0 && n > 0 &&
         k > 0 &&
         // 16-byte aligned leading dimensions: K bytes of FP8, M and N elements of the output
         k % 16 == 0 && m % 8 == 0 && n % 8 == 0;
}

}  // namespace jax_fp8
