#pragma once
// The 16-bit grouped GEMM "jax_fp8_ragged_dot" (CUDA): jax.lax.ragged_dot's product and the
// two products of its gradients, chosen by the attribute `mode` (ragged_dot.h states the
// arithmetic and the shapes, ragged_dot_limits.h the sizes it takes). The second result is
// the workspace (grouped_gemm_workspace.h), a buffer XLA allocates.
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// The execute stage (command-buffer compatible) and the initialize stage (the kernel's
// attributes and the device's SM count, before any capture), one handler bundle.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8RaggedDotCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8RaggedDotInitializeCuda);

}  // namespace jax_fp8
