// jax_fp8_grouped_gemm's configuration "e4m3_bf16": E4M3 lhs x E4M3 rhs, bf16 out
// (grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

JAX_FP8_GROUPED_GEMM_CONFIG(kGroupedE4m3Bf16, "e4m3_bf16", false, true, cutlass::float_e4m3_t,
                            cutlass::bfloat16_t)
