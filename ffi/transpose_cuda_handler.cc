// XLA FFI handler "jax_fp8_transpose_bytes" (CUDA): checks the buffers, then one launch
// on XLA's stream. Command-buffer compatible: it only enqueues work.
#include "transpose_cuda_handler.h"

#include <string>

#include "transpose_cuda.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

ffi::Error TransposeBytesImpl(cudaStream_t stream, ffi::AnyBuffer in,
                              ffi::Result<ffi::AnyBuffer> out) {
  const auto in_dims = in.dimensions();
  const auto out_dims = out->dimensions();
  const size_t rank = in_dims.size();
  if (ffi::ByteWidth(in.element_type()) != 1 || out->element_type() != in.element_type()) {
    return ffi::Error::InvalidArgument(
        "jax_fp8_transpose_bytes: operand and result must have the same 1-byte type");
  }
  if (rank < 2 || out_dims.size() != rank) {
    return ffi::Error::InvalidArgument(
        "jax_fp8_transpose_bytes: operand and result must have the same rank >= 2");
  }
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (out_dims[i] != in_dims[i]) {
      return ffi::Error::InvalidArgument("jax_fp8_transpose_bytes: leading axes differ");
    }
    batch *= in_dims[i];
  }
  const int64_t rows = in_dims[rank - 2], cols = in_dims[rank - 1];
  if (out_dims[rank - 2] != cols || out_dims[rank - 1] != rows) {
    return ffi::Error::InvalidArgument(
        "jax_fp8_transpose_bytes: result must be the operand with its last two axes swapped");
  }
  if (batch == 0 || rows == 0 || cols == 0) return ffi::Error::Success();
  if (!TransposeBytesSupports(batch, rows, cols)) {
    return ffi::Error::InvalidArgument(
        "jax_fp8_transpose_bytes: sizes not supported (the last two axes must be multiples "
        "of 4): " + std::to_string(batch) + " x " + std::to_string(rows) + " x " +
        std::to_string(cols));
  }
  const cudaError_t err =
      LaunchTransposeBytes(stream, in.untyped_data(), out->untyped_data(), batch, rows, cols);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_fp8_transpose_bytes: CUDA launch failed: ") +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8TransposeBytesCuda, TransposeBytesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
