#pragma once
// Index arithmetic shared by host and device code, and the one definition of the block
// GEMM's (cuBLASLt's) scale layout.
//
// An operand [R, K] scaled per 1 x 128 block or 128 x 128 tile has Rb x Kb scales, Rb = R
// (blocks) or ceil(R / 128) (tiles), Kb = ceil(K / 128). cuBLASLt reads them as float32
//   1 x 128 blocks:   [Kb, round_up(R, 4)]    (R contiguous)
//   128 x 128 tiles:  [Rb, round_up(Kb, 4)]
// per GEMM of a batch; the padding holds 1.0. jax_fp8/_primitives/block_quantize.py's
// gemm_scale_shape is the same layout in Python.
#include <cstdint>

#if defined(__CUDACC__)
#define JAX_FP8_HOST_DEVICE __host__ __device__
#else
#define JAX_FP8_HOST_DEVICE
#endif

namespace jax_fp8 {

JAX_FP8_HOST_DEVICE constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
JAX_FP8_HOST_DEVICE constexpr int64_t RoundUp4(int64_t a) { return (a + 3) / 4 * 4; }

constexpr int64_t kScaleBlock = 128;

// One GEMM's scale array in cuBLASLt's layout: `outer` rows of `ld` floats (ld padded to 4).
struct GemmScaleDims {
  int64_t outer, ld;
};

// The layout above for an operand [rows, k]: tiles [Rb, round_up(Kb, 4)], blocks [Kb,
// round_up(R, 4)].
JAX_FP8_HOST_DEVICE constexpr GemmScaleDims GemmScaleLayout(int64_t rows, int64_t k, bool tile) {
  return tile ? GemmScaleDims{CeilDiv(rows, kScaleBlock), RoundUp4(CeilDiv(k, kScaleBlock))}
              : GemmScaleDims{CeilDiv(k, kScaleBlock), RoundUp4(rows)};
}

}  // namespace jax_fp8
