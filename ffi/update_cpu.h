#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
// XLA FFI handler "jax_fp8_update" for the Host platform.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8UpdateCpu);
}  // namespace jax_fp8
