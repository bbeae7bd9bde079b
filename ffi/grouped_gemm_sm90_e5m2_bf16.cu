// jax_fp8_grouped_gemm's configuration "e5m2_bf16": E5M2 lhs x E4M3 rhs, bf16 out
// (grouped_gemm_sm90.cuh).
#include "grouped_gemm_sm90.cuh"

JAX_FP8_GROUPED_GEMM_CONFIG(kGroupedE5m2Bf16, "e5m2_bf16", true, true, cutlass::float_e5m2_t,
                            cutlass::bfloat16_t)
