// XLA FFI handler "jax_fp8_split_rows" (CUDA): check the buffers, then enqueue on XLA's
// stream (command-buffer compatible).
#include "split_cuda_handler.h"

#include <string>
#include <vector>

#include "cuda_handler_util.h"
#include "split_cuda.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

ffi::Error SplitRowsImpl(cudaStream_t stream, ffi::AnyBuffer src, ffi::RemainingRets pieces) {
  constexpr const char* kName = "jax_fp8_split_rows: ";
  if (src.element_type() != ffi::DataType::F32 || src.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument(std::string(kName) + "the operand must be float32[R]");
  }
  std::vector<float*> dsts(pieces.size());
  std::vector<int64_t> counts(pieces.size());
  int64_t total = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    auto piece = pieces.get<ffi::AnyBuffer>(k);
    if (!piece.has_value()) return piece.error();
    if ((*piece)->element_type() != ffi::DataType::F32 || (*piece)->dimensions().size() != 1) {
      return ffi::Error::InvalidArgument(std::string(kName) + "result " + std::to_string(k) +
                                         " is not a float32 vector");
    }
    dsts[k] = static_cast<float*>((*piece)->untyped_data());
    counts[k] = (*piece)->dimensions()[0];
    total += counts[k];
  }
  if (total != src.dimensions()[0]) {
    return ffi::Error::InvalidArgument(
        std::string(kName) + "the results hold " + std::to_string(total) +
        " floats, the operand " + std::to_string(src.dimensions()[0]));
  }
  const char* why = nullptr;
  const cudaError_t err = LaunchSplitRows(stream, static_cast<const float*>(src.untyped_data()),
                                          dsts.data(), counts.data(), dsts.size(), &why);
  return LaunchStatus("jax_fp8_split_rows", err, why);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8SplitRowsCuda, SplitRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
