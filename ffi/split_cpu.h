#pragma once
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
// XLA FFI handler "jax_fp8_split_rows" for the Host platform: f32[R] -> f32[n_0], ...,
// f32[n_{K-1}] (consecutive pieces, n_0 + ... + n_{K-1} = R), copied.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8SplitRowsCpu);
}  // namespace jax_fp8
