// jax_fp8_ragged_dot's configuration "wgrad_bf16": kRaggedWeightGrad (ragged_dot.h), bf16 operands
// and out (ragged_dot_sm90.cuh).
#include "ragged_dot_sm90.cuh"

JAX_FP8_RAGGED_DOT_CONFIG(kRaggedDotWgradBf16, "wgrad_bf16", jax_fp8::kRaggedWeightGrad, false,
                          false, cutlass::bfloat16_t, cutlass::bfloat16_t)
