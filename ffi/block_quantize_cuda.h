#pragma once
// Blockwise FP8 quantization on the GPU (docs/semantics.md, "Current and blockwise scaling"): each
// 1 x 128 block or 128 x 128 tile of x [B, M, K] gets its scale from its own amax, and the
// kernel writes the row-wise copy, the column-wise copy (x transposed, blocks along M) or
// both from one read of x.
#include <cstdint>

#include <cuda_runtime.h>

#include "element_types.h"

namespace jax_fp8 {

struct BlockQuantizeArgs {
  InType in_type;
  Fp8Type fp8_type;
  const void* x;  // [batch, rows, cols]
  int64_t batch, rows, cols;
  bool tile_2d;  // 128 x 128 tiles; else 1 x 128 blocks along the last axis
  // Row-wise: q [batch, rows, cols], scale_inv [batch, rows or ceil(rows/128), ceil(cols/128)].
  void* q;
  float* scale_inv;
  // Column-wise (quantize_blocks of x with its last two axes swapped):
  // q_t [batch, cols, rows], scale_inv_t [batch, cols or ceil(cols/128), ceil(rows/128)].
  void* q_t;
  float* scale_inv_t;
  float amax_epsilon;
  bool power_of_2_scale;
  // Both scale_inv in the block GEMM's layout instead (block_scale_layout.h; the padding
  // is 1.0), where the operand is q [rows, cols] or q_t [cols, rows].
  bool gemm_layout;
};

// Whether the kernel takes these sizes (the grid fits CUDA's limits).
bool BlockQuantizeSupports(int64_t batch, int64_t rows, int64_t cols);

// Enqueues the kernel; q/scale_inv or q_t/scale_inv_t may be null (not wanted).
cudaError_t LaunchBlockQuantize(cudaStream_t stream, const BlockQuantizeArgs& args);

}  // namespace jax_fp8
