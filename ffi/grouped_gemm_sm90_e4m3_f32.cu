// jax_fp8_grouped_gemm's configuration "e4m3_f32": E4M3 lhs x E4M3 rhs, f32 out
// (grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

JAX_FP8_GROUPED_GEMM_CONFIG(kGroupedE4m3F32, "e4m3_f32", false, false, cutlass::float_e4m3_t, float)
