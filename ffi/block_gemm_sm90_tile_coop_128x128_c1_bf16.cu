// CUTLASS block-scaled GEMM configuration "tile_coop_128x128_c1_bf16": b in 128 x 128 tiles
// (forward, data gradient), bf16 out, 128x128x128 CTA tile, 1x1x1 cluster, cooperative
// (block_gemm_cutlass_sm90.cuh).
#include "block_gemm_cutlass_sm90.cuh"

JAX_FP8_CUTLASS_CONFIG(kTileCoop128x128C1Bf16, "tile_coop_128x128_c1_bf16", true, true, 128,
                       cutlass::bfloat16_t, cute::Shape<cute::_128, cute::_128, cute::_128>,
                       cute::Shape<cute::_1, cute::_1, cute::_1>, false)
