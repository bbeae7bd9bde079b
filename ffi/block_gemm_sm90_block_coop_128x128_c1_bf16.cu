// CUTLASS block-scaled GEMM configuration "block_coop_128x128_c1_bf16": b in 1 x 128 blocks (weight
// gradient), bf16 out, 128x128x128 CTA tile, 1x1x1 cluster, cooperative
// (block_gemm_cutlass_sm90.cuh).
#include "block_gemm_cutlass_sm90.cuh"

JAX_FP8_CUTLASS_CONFIG(kBlockCoop128x128C1Bf16, "block_coop_128x128_c1_bf16", false, true, 1,
                       cutlass::bfloat16_t, cute::Shape<cute::_128, cute::_128, cute::_128>,
                       cute::Shape<cute::_1, cute::_1, cute::_1>, false)
