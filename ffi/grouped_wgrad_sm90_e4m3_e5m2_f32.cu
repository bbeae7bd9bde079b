// jax_fp8_grouped_wgrad's configuration "e4m3_e5m2_f32": E4M3 lhs x E5M2 grad, float32 out
// (grouped_wgrad_sm90.cuh).
#include "grouped_wgrad_sm90.cuh"

JAX_FP8_GROUPED_WGRAD_CONFIG(kGroupedWgradE4m3E5m2F32, "e4m3_e5m2_f32", true, false,
                             cutlass::float_e5m2_t, float)
