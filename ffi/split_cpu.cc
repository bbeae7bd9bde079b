// CPU handler of "jax_fp8_split_rows": the pieces copied out of the packed vector (what
// XLA's slices compute). As one custom call, a packed state's scale vector has one user
// in the step instead of one slice per state, which XLA:CPU's fusion passes compile
// faster.
#include "split_cpu.h"

#include <cstring>
#include <string>

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

ffi::Error SplitRowsCpuImpl(ffi::AnyBuffer src, ffi::RemainingRets pieces) {
  constexpr const char* kName = "jax_fp8_split_rows: ";
  if (src.element_type() != ffi::DataType::F32 || src.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(std::string(kName) + "the operand must be float32[R]");
  }
  const int64_t total = src.dimensions()[0];
  const float* from = static_cast<const float*>(src.untyped_data());
  int64_t offset = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    auto piece = pieces.get<ffi::AnyBuffer>(k);
    if (!piece.has_value()) return piece.error();
    if ((*piece)->element_type() != ffi::DataType::F32 || (*piece)->dimensions().size() != 1) {
      return ffi::Error::InvalidArgument(std::string(kName) + "result " + std::to_string(k) +
                                         " is not a float32 vector");
    }
    const int64_t count = (*piece)->dimensions()[0];
    if (count > total - offset) {
      return ffi::Error::InvalidArgument(std::string(kName) + "the results hold more than " +
                                         std::to_string(total) + " floats");
    }
    if (count > 0) {
      std::memcpy((*piece)->untyped_data(), from + offset, sizeof(float) * count);
    }
    offset += count;
  }
  if (offset != total) {
    return ffi::Error::InvalidArgument(std::string(kName) + "the results hold " +
                                       std::to_string(offset) + " floats, the operand " +
                                       std::to_string(total));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8SplitRowsCpu, SplitRowsCpuImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().RemainingRets());

}  // namespace jax_fp8
