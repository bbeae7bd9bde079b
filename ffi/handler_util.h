#pragma once
// Pieces the FFI handlers of both platforms share: error messages naming the target, and
// the decode of jax_fp8_split_rows's buffers.
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// "[d0, d1, ...]" for error messages.
inline std::string ShapeString(xla::ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline xla::ffi::Error InvalidArgument(const char* target, const std::string& msg) {
  return xla::ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

// jax_fp8_split_rows's call: the operand float32[R] and its pieces, float32 vectors
// whose lengths sum to R.
struct SplitRows {
  const float* src;
  std::vector<float*> dsts;
  std::vector<int64_t> counts;
};

inline xla::ffi::ErrorOr<SplitRows> DecodeSplitRows(xla::ffi::AnyBuffer src,
                                                    xla::ffi::RemainingRets pieces) {
  namespace ffi = xla::ffi;
  constexpr const char* kName = "jax_fp8_split_rows";
  if (src.element_type() != ffi::DataType::F32 || src.dimensions().size() != 1) {
    return ffi::Unexpected(InvalidArgument(kName, "the operand must be float32[R]"));
  }
  SplitRows call{static_cast<const float*>(src.untyped_data()), std::vector<float*>(pieces.size()),
                 std::vector<int64_t>(pieces.size())};
  int64_t total = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    auto piece = pieces.get<ffi::AnyBuffer>(k);
    if (!piece.has_value()) return ffi::Unexpected(piece.error());
    if ((*piece)->element_type() != ffi::DataType::F32 || (*piece)->dimensions().size() != 1) {
      return ffi::Unexpected(
          InvalidArgument(kName, "result " + std::to_string(k) + " is not a float32 vector"));
    }
    call.dsts[k] = static_cast<float*>((*piece)->untyped_data());
    call.counts[k] = (*piece)->dimensions()[0];
    total += call.counts[k];
  }
  if (total != src.dimensions()[0]) {
    return ffi::Unexpected(InvalidArgument(kName, "the results hold " + std::to_string(total) +
                                                      " floats, the operand " +
                                                      std::to_string(src.dimensions()[0])));
  }
  return call;
}

}  // namespace jax_fp8
