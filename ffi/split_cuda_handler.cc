// XLA FFI handler "jax_fp8_split_rows" (CUDA): check the buffers, then enqueue on XLA's
// stream (command-buffer compatible).
#include "split_cuda_handler.h"

#include "cuda_handler_util.h"
#include "split_cuda.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

ffi::Error SplitRowsImpl(cudaStream_t stream, ffi::AnyBuffer src, ffi::RemainingRets pieces) {
  auto call = DecodeSplitRows(src, pieces);
  if (!call.has_value()) return call.error();
  const char* why = nullptr;
  const cudaError_t err = LaunchSplitRows(stream, call->src, call->dsts.data(), call->counts.data(),
                                          call->dsts.size(), &why);
  return LaunchStatus("jax_fp8_split_rows", err, why);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFp8SplitRowsCuda, SplitRowsImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>().RemainingRets(),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
