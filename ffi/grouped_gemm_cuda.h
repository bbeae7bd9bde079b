#pragma once
// The grouped FP8 GEMM "jax_fp8_grouped_gemm" (CUDA): for each group g of consecutive rows of
// lhs [M, K] (sizes group_sizes int32 [G]), out rows = alpha_g * (lhs rows . rhs[g]^T), rhs
// [G, N, K], alpha_g = lhs_scale_inv[g] * rhs_scale_inv[g]; rows past the groups 0
// (grouped_gemm.h states the arithmetic, grouped_gemm_limits.h the sizes it takes). The
// second result is the workspace (grouped_gemm_workspace.h), a buffer XLA allocates.
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// The execute stage (command-buffer compatible) and the initialize stage (the kernel's
// attributes and the device's SM count, before any capture), one handler bundle.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8GroupedGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8GroupedGemmInitializeCuda);

}  // namespace jax_fp8
