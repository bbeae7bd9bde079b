#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
// XLA FFI handler "jax_fp8_update" for the CUDA platform.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8UpdateCuda);
}  // namespace jax_fp8
