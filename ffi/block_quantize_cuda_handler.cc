// XLA FFI handler "jax_fp8_block_quantize" (CUDA): checks the buffers against the
// attributes, then enqueues one kernel on XLA's stream (command-buffer compatible).
#include "block_quantize_cuda_handler.h"

#include <string>
#include <vector>

#include "block_quantize_cuda.h"
#include "block_scale_layout.h"
#include "cuda_handler_util.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

constexpr const char* kName = "jax_fp8_block_quantize";

ffi::Error Invalid(const std::string& msg) { return InvalidArgument(kName, msg); }

// Checks one (data, scale_inv) result pair: data `lead + {r, c}` of the FP8 type, scales
// float32 `lead + {r or ceil(r/128), ceil(c/128)}`, or in the GEMM layout
// (block_scale_layout.h).
ffi::Error CheckPair(ffi::AnyBuffer data, ffi::AnyBuffer scale, const std::vector<int64_t>& lead,
                     int64_t r, int64_t c, bool tile_2d, bool gemm_layout, ffi::DataType fp8,
                     const char* what) {
  std::vector<int64_t> want_data = lead, want_scale = lead;
  want_data.push_back(r);
  want_data.push_back(c);
  if (gemm_layout) {
    const GemmScaleDims g = GemmScaleLayout(r, c, tile_2d);
    want_scale.push_back(g.outer);
    want_scale.push_back(g.ld);
  } else {
    want_scale.push_back(tile_2d ? CeilDiv(r, kScaleBlock) : r);
    want_scale.push_back(CeilDiv(c, kScaleBlock));
  }
  const auto dd = data.dimensions(), sd = scale.dimensions();
  if (data.element_type() != fp8 || std::vector<int64_t>(dd.begin(), dd.end()) != want_data) {
    return Invalid(std::string(what) + " data must be " + ShapeString(want_data) +
                   " of one FP8 type, got " + ShapeString(dd));
  }
  if (scale.element_type() != ffi::DataType::F32 ||
      std::vector<int64_t>(sd.begin(), sd.end()) != want_scale) {
    return Invalid(std::string(what) + " scale_inv must be float32 " + ShapeString(want_scale) +
                   ", got " + ShapeString(sd));
  }
  return ffi::Error::Success();
}

ffi::Error BlockQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets,
                             bool tile_2d, bool rowwise, bool colwise, float amax_epsilon,
                             bool power_of_2_scale, bool gemm_layout) {
  BlockQuantizeArgs a{};
  if (!DecodeInType(x.element_type(), &a.in_type)) return Invalid("x must be f32, bf16 or f16");
  const auto dims = x.dimensions();
  if (dims.size() < 2) return Invalid("x must have rank >= 2, got " + ShapeString(dims));
  if (!rowwise && !colwise) return Invalid("nothing to compute");
  if (rets.size() != 2u * (rowwise + colwise)) {
    return Invalid("expected " + std::to_string(2 * (rowwise + colwise)) + " results, got " +
                   std::to_string(rets.size()));
  }
  const size_t rank = dims.size();
  std::vector<int64_t> lead(dims.begin(), dims.end() - 2);
  a.batch = 1;
  for (int64_t d : lead) a.batch *= d;
  a.rows = dims[rank - 2];
  a.cols = dims[rank - 1];
  a.tile_2d = tile_2d;
  a.amax_epsilon = amax_epsilon;
  a.power_of_2_scale = power_of_2_scale;
  a.gemm_layout = gemm_layout;
  a.x = x.untyped_data();
  size_t next = 0;
  ffi::DataType fp8 = ffi::DataType::INVALID;
  for (int pass = 0; pass < 2; ++pass) {
    const bool wanted = pass == 0 ? rowwise : colwise;
    if (!wanted) continue;
    auto data = rets.get<ffi::AnyBuffer>(next++);
    auto scale = rets.get<ffi::AnyBuffer>(next++);
    if (!data.has_value() || !scale.has_value()) return Invalid("cannot decode the results");
    if (fp8 == ffi::DataType::INVALID) fp8 = (*data)->element_type();
    if (!DecodeFp8Type(fp8, &a.fp8_type)) return Invalid("results must be f8e4m3fn or f8e5m2");
    ffi::Error err = pass == 0 ? CheckPair(**data, **scale, lead, a.rows, a.cols, tile_2d,
                                           gemm_layout, fp8, "row-wise")
                               : CheckPair(**data, **scale, lead, a.cols, a.rows, tile_2d,
                                           gemm_layout, fp8, "column-wise");
    if (err.failure()) return err;
    if (pass == 0) {
      a.q = (*data)->untyped_data();
      a.scale_inv = static_cast<float*>((*scale)->untyped_data());
    } else {
      a.q_t = (*data)->untyped_data();
      a.scale_inv_t = static_cast<float*>((*scale)->untyped_data());
    }
  }
  if (a.batch == 0 || a.rows == 0 || a.cols == 0) return ffi::Error::Success();
  if (!BlockQuantizeSupports(a.batch, a.rows, a.cols)) {
    return Invalid("sizes not supported: " + ShapeString(dims));
  }
  return LaunchStatus(kName, LaunchBlockQuantize(stream, a));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8BlockQuantizeCuda, BlockQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingRets()
                                  .Attr<bool>("tile_2d")
                                  .Attr<bool>("rowwise")
                                  .Attr<bool>("colwise")
                                  .Attr<float>("amax_epsilon")
                                  .Attr<bool>("power_of_2_scale")
                                  .Attr<bool>("gemm_layout"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
