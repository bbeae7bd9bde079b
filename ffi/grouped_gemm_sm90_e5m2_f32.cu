// jax_fp8_grouped_gemm's configuration "e5m2_f32": E5M2 lhs x E4M3 rhs, f32 out
// (grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

JAX_FP8_GROUPED_GEMM_CONFIG(kGroupedE5m2F32, "e5m2_f32", true, false, cutlass::float_e5m2_t, float)
