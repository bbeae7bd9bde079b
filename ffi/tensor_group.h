// What one FFI operand group is, once decoded: plain pointers, no XLA types, so the
// CUDA translation unit need not see the XLA FFI headers.
#pragma once

#include <cstdint>

namespace jax_fp8 {

// `count` tensors of history length `len`, stored contiguously (the leading axes
// of one state array, flattened). The state outputs alias their inputs, so the
// update writes through `history` and `scale`.
struct TensorGroup {
  float* history;      // [count, len]
  float* scale;        // [count]
  float* scale_inv;    // [count], written only
  const float* amax;   // [count], or nullptr when no amax was given
  int64_t count;
  int64_t len;
  float scaled_max;    // float32(fp8_max) * float32(2^-margin)
};

}  // namespace jax_fp8
