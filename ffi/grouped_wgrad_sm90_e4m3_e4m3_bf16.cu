// jax_fp8_grouped_wgrad's configuration "e4m3_e4m3_bf16": E4M3 lhs x E4M3 grad, bf16 out
// (grouped_wgrad_sm90.cuh).
#include "grouped_wgrad_sm90.cuh"

JAX_FP8_GROUPED_WGRAD_CONFIG(kGroupedWgradE4m3E4m3Bf16, "e4m3_e4m3_bf16", false, true,
                             cutlass::float_e4m3_t, cutlass::bfloat16_t)
