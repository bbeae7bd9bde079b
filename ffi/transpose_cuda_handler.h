#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
// XLA FFI handler "jax_fp8_transpose_bytes" for the CUDA platform: [..., R, C] ->
// [..., C, R] for 1-byte element types (FP8).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8TransposeBytesCuda);
}  // namespace jax_fp8
