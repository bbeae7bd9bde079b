// jax_fp8_ragged_dot's configuration "wgrad_bf16_f32": kRaggedWeightGrad (ragged_dot.h), bf16
// operands, float32 out (each device's partial sums under a jit over several devices)
// (ragged_dot_sm90.cuh).
#include "ragged_dot_sm90.cuh"

JAX_FP8_RAGGED_DOT_CONFIG(kRaggedDotWgradBf16F32, "wgrad_bf16_f32", jax_fp8::kRaggedWeightGrad,
                          false, true, cutlass::bfloat16_t, float)
