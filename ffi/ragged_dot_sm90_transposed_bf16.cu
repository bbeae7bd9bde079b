// jax_fp8_ragged_dot's configuration "transposed_bf16": kRaggedTransposed (ragged_dot.h), bf16
// operands and out (ragged_dot_sm90.cuh).
#include "ragged_dot_sm90.cuh"

JAX_FP8_RAGGED_DOT_CONFIG(kRaggedDotTransposedBf16, "transposed_bf16", jax_fp8::kRaggedTransposed,
                          false, false, cutlass::bfloat16_t, cutlass::bfloat16_t)
