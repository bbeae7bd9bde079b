#pragma once
// The block-scaled FP8 GEMM "jax_fp8_block_gemm" (CUDA): cuBLASLt's FP8 matmul with
// 1 x 128 (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) and 128 x 128
// (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F) scale modes, cuBLAS >= 12.9 on SM90.
// libcublasLt is not linked: it is dlopen'ed from the path the Python side finds (the
// nvidia-cublas wheel JAX's CUDA plugin uses), on first use.
//
// Operands (row-major): a [..., M, K], b [..., N, K] (FP8), out [..., M, N] = a . b^T.
// Scales in the layout cuBLASLt reads (block_scale_layout.h), one array per GEMM of the batch.
// jax_fp8 emits the call for the GEMMs cuBLASLt takes (block_gemm_limits.h); the handler
// also computes others (a forced `kernel`), with its plain kernel where cuBLASLt has none.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// The execute stage (command-buffer compatible) and the initialize stage (makes the
// cuBLASLt handle and the plan), registered together as the target's handler bundle.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8BlockGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFp8BlockGemmInitializeCuda);

// One GEMM of the batch, for the plain CUDA kernel used where cuBLASLt has no algorithm
// (a shape, alignment or type combination it rejects). Scales in the layout above;
// scale_ld is the padded minor extent of the scale array.
struct BlockGemmArgs {
  const uint8_t* a;
  const float* a_scale;
  bool a_e5m2, a_tile;
  int64_t a_scale_ld;
  const uint8_t* b;
  const float* b_scale;
  bool b_e5m2, b_tile;
  int64_t b_scale_ld;
  void* out;
  bool out_bf16;
  int64_t m, n, k;
};

// out = sum over K blocks of (a_blk . b_blk^T) * scale_a * scale_b, accumulated in float32.
cudaError_t LaunchBlockGemmFallback(cudaStream_t stream, const BlockGemmArgs& args);

}  // namespace jax_fp8
