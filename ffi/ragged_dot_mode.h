#pragma once
// The three products of jax_fp8_ragged_dot (ragged_dot.h states them). Plain C++.

namespace jax_fp8 {

enum RaggedDotMode : int { kRaggedForward = 0, kRaggedTransposed = 1, kRaggedWeightGrad = 2 };

}  // namespace jax_fp8
