#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
// XLA FFI handler "jax_fp8_transpose_bytes" for the CUDA platform: [..., R, C] ->
// [..., C, R] for 1-byte element types (FP8).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8TransposeBytesCuda);
// "jax_fp8_quantize_transpose": x [R, C] (f32/bf16/f16), scale f32[] -> the FP8 q [R, C],
// q transposed [C, R] and max |x| (f32[]), in one pass over x; or a batch of matrices,
// x [B, R, C] and scale f32[B] -> q [B, R, C], q_t [B, C, R], amax f32[B].
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8QuantizeTransposeCuda);
}  // namespace jax_fp8
