#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
// XLA FFI handler "jax_fp8_block_quantize" (CUDA): x [..., M, K] (f32/bf16/f16) -> the
// row-wise copy (q [..., M, K], scale_inv), the column-wise copy (q_t [..., K, M],
// scale_inv_t) or both, in that order, with 1 x 128 blocks or 128 x 128 tiles.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8BlockQuantizeCuda);
}  // namespace jax_fp8
