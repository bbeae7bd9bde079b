// jax_fp8_grouped_wgrad's configuration "e4m3_e4m3_f32": E4M3 lhs x E4M3 grad, float32 out
// (grouped_wgrad_sm90.cuh).
#include "grouped_wgrad_sm90.cuh"

JAX_FP8_GROUPED_WGRAD_CONFIG(kGroupedWgradE4m3E4m3F32, "e4m3_e4m3_f32", false, false,
                             cutlass::float_e4m3_t, float)
