// What one FFI operand group is, once decoded: plain pointers, no XLA types, so the
// CUDA translation unit need not see the XLA FFI headers.
#pragma once

#include <cstdint>

namespace jax_fp8 {

// `count` tensors of history length `len`, stored contiguously (the leading axes
// of one state array, flattened). In place (the state outputs alias their inputs) the
// out pointers are null or equal to the inputs; out of place they are the results'.
struct TensorGroup {
  float* history;     // [count, len], read (and written, in place)
  float* scale;       // [count], read (and written, in place)
  float* scale_inv;   // [count], written only
  const float* amax;  // [count], or nullptr when no amax was given
  int64_t count;
  int64_t len;
  float scaled_max;              // float32(fp8_max) * float32(2^-margin)
  float* history_out = nullptr;  // [count, len]; nullptr: `history`
  float* scale_out = nullptr;    // [count]; nullptr: `scale`

  float* HistoryOut() const { return history_out ? history_out : history; }
  float* ScaleOut() const { return scale_out ? scale_out : scale; }
};

}  // namespace jax_fp8
