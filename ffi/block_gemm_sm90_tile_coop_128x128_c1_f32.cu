// CUTLASS block-scaled GEMM configuration "tile_coop_128x128_c1_f32": b in 128 x 128 tiles
// (forward, data gradient), float32 out, 128x128x128 CTA tile, 1x1x1 cluster, cooperative
// (block_gemm_cutlass_sm90.cuh).
#include "block_gemm_cutlass_sm90.cuh"

JAX_FP8_CUTLASS_CONFIG(kTileCoop128x128C1F32, "tile_coop_128x128_c1_f32", true, false, 128, float,
                       cute::Shape<cute::_128, cute::_128, cute::_128>,
                       cute::Shape<cute::_1, cute::_1, cute::_1>, false)
