// CUTLASS block-scaled GEMM configuration "block_pp_64x128_c1_f32": b in 1 x 128 blocks (weight
// gradient), float32 out, 64x128x128 CTA tile, 1x1x1 cluster, ping-pong
// (block_gemm_cutlass_sm90.cuh).
#include "block_gemm_cutlass_sm90.cuh"

JAX_FP8_CUTLASS_CONFIG(kBlockPp64x128C1F32, "block_pp_64x128_c1_f32", false, false, 1, float,
                       cute::Shape<cute::_64, cute::_128, cute::_128>,
                       cute::Shape<cute::_1, cute::_1, cute::_1>, true)
