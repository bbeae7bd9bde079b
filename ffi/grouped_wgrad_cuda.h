#pragma once
// The grouped FP8 weight-gradient GEMM "jax_fp8_grouped_wgrad" (CUDA): for each group g of
// consecutive token columns of the padded, transposed operands lhs_t [K, Mp] and grad_t
// [N, Mp] (sizes group_sizes int32 [G]), out[g] [K, N] = alpha_g * lhs_t_g . grad_t_g^T,
// alpha_g = lhs_scale_inv[g] * grad_scale_inv[g], the sizes clamped to the attribute m (the
// rows of the untransposed operands) (grouped_wgrad.h states the layout and the
// arithmetic, grouped_wgrad_limits.h the sizes it takes). The second result is the workspace
// (grouped_gemm_workspace.h), a buffer XLA allocates.
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// The execute stage (command-buffer compatible) and the initialize stage (the kernel's
// attributes and the device's SM count, before any capture), one handler bundle.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8GroupedWgradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8GroupedWgradInitializeCuda);

}  // namespace jax_fp8
