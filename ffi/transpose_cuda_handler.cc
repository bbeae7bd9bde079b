// XLA FFI handlers "jax_fp8_transpose_bytes" and "jax_fp8_quantize_transpose" (CUDA):
// check the buffers, then enqueue on XLA's stream (command-buffer compatible).
#include "transpose_cuda_handler.h"

#include <string>

#include "cuda_handler_util.h"
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
        "of 4): " +
        std::to_string(batch) + " x " + std::to_string(rows) + " x " + std::to_string(cols));
  }
  return LaunchStatus(
      "jax_fp8_transpose_bytes",
      LaunchTransposeBytes(stream, in.untyped_data(), out->untyped_data(), batch, rows, cols));
}

ffi::Error QuantizeTransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                                 ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> q_t,
                                 ffi::Result<ffi::AnyBuffer> amax, float fp8_max) {
  constexpr const char* kName = "jax_fp8_quantize_transpose";
  InType in_type;
  if (!DecodeInType(x.element_type(), &in_type)) {
    return InvalidArgument(kName, "x must be f32, bf16 or f16");
  }
  Fp8Type fp8_type;
  if (!DecodeFp8Type(q->element_type(), &fp8_type)) {
    return InvalidArgument(kName, "q must be f8e4m3fn or f8e5m2");
  }
  // [R, C] with scalars, or a batch [B, R, C] with scale and amax [B].
  const auto dims = x.dimensions();
  const size_t rank = dims.size();
  const bool batched = rank == 3;
  if ((rank != 2 && rank != 3) || q->dimensions().size() != rank ||
      q_t->dimensions().size() != rank || q_t->element_type() != q->element_type()) {
    return InvalidArgument(kName,
                           "x, q must be [R, C] or [B, R, C] and q_t [C, R] or [B, C, R] "
                           "of q's type");
  }
  const int64_t batch = batched ? dims[0] : 1, rows = dims[rank - 2], cols = dims[rank - 1];
  const auto qd = q->dimensions(), td = q_t->dimensions();
  if ((batched && (qd[0] != batch || td[0] != batch)) || qd[rank - 2] != rows ||
      qd[rank - 1] != cols || td[rank - 2] != cols || td[rank - 1] != rows) {
    return InvalidArgument(kName,
                           "x, q must be [R, C] or [B, R, C] and q_t [C, R] or [B, C, R] "
                           "of q's type");
  }
  auto per_matrix = [&](ffi::DataType t, ffi::Span<const int64_t> d) {
    return t == ffi::DataType::F32 && (batched ? d.size() == 1 && d[0] == batch : d.size() == 0);
  };
  if (!per_matrix(scale.element_type(), scale.dimensions()) ||
      !per_matrix(amax->element_type(), amax->dimensions())) {
    return InvalidArgument(kName,
                           "scale and amax must be float32 scalars, or float32[B] for x "
                           "[B, R, C]");
  }
  if (batch == 0) return ffi::Error::Success();
  if (!TransposeBytesSupports(batch, rows, cols)) {
    return InvalidArgument(kName, "sizes not supported: " + std::to_string(batch) + " x " +
                                      std::to_string(rows) + " x " + std::to_string(cols));
  }
  return LaunchStatus(kName, LaunchQuantizeTranspose(
                                 stream, in_type, fp8_type, x.untyped_data(),
                                 static_cast<const float*>(scale.untyped_data()), q->untyped_data(),
                                 q_t->untyped_data(), static_cast<float*>(amax->untyped_data()),
                                 batch, rows, cols, fp8_max));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8QuantizeTransposeCuda, QuantizeTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("fp8_max"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8TransposeBytesCuda, TransposeBytesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
