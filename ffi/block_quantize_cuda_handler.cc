// XLA FFI handler "jax_fp8_block_quantize" (CUDA): checks the buffers against the
// attributes, then enqueues one kernel on XLA's stream (command-buffer compatible).
#include "block_quantize_cuda_handler.h"

#include <string>
#include <vector>

#include "block_quantize_cuda.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

constexpr const char* kName = "jax_fp8_block_quantize: ";

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(kName) + msg);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

int64_t RoundUp4(int64_t a) { return (a + 3) / 4 * 4; }

// Checks one (data, scale_inv) result pair: data `lead + {r, c}` of the FP8 type, scales
// float32 `lead + {r or ceil(r/128), ceil(c/128)}`, or in the GEMM layout
// `lead + {ceil(c/128), round_up(r, 4)}` (1-D) / `lead + {ceil(r/128), round_up(ceil(c/128), 4)}`.
ffi::Error CheckPair(ffi::AnyBuffer data, ffi::AnyBuffer scale, const std::vector<int64_t>& lead,
                     int64_t r, int64_t c, bool tile_2d, bool gemm_layout, ffi::DataType fp8,
                     const char* what) {
  std::vector<int64_t> want_data = lead, want_scale = lead;
  want_data.push_back(r);
  want_data.push_back(c);
  if (!gemm_layout) {
    want_scale.push_back(tile_2d ? CeilDiv(r, 128) : r);
    want_scale.push_back(CeilDiv(c, 128));
  } else if (tile_2d) {
    want_scale.push_back(CeilDiv(r, 128));
    want_scale.push_back(RoundUp4(CeilDiv(c, 128)));
  } else {
    want_scale.push_back(CeilDiv(c, 128));
    want_scale.push_back(RoundUp4(r));
  }
  const auto dd = data.dimensions(), sd = scale.dimensions();
  if (data.element_type() != fp8 || std::vector<int64_t>(dd.begin(), dd.end()) != want_data) {
    return Invalid(std::string(what) + " data must be " + Shape(want_data) + " of one FP8 type, got " +
                   Shape(dd));
  }
  if (scale.element_type() != ffi::DataType::F32 ||
      std::vector<int64_t>(sd.begin(), sd.end()) != want_scale) {
    return Invalid(std::string(what) + " scale_inv must be float32 " + Shape(want_scale) + ", got " +
                   Shape(sd));
  }
  return ffi::Error::Success();
}

ffi::Error BlockQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingRets rets,
                             bool tile_2d, bool rowwise, bool colwise, float amax_epsilon,
                             bool power_of_2_scale, bool gemm_layout) {
  BlockQuantizeArgs a{};
  switch (x.element_type()) {
    case ffi::DataType::F32: a.in_type = InType::kF32; break;
    case ffi::DataType::BF16: a.in_type = InType::kBF16; break;
    case ffi::DataType::F16: a.in_type = InType::kF16; break;
    default: return Invalid("x must be f32, bf16 or f16");
  }
  const auto dims = x.dimensions();
  if (dims.size() < 2) return Invalid("x must have rank >= 2, got " + Shape(dims));
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
    if (fp8 != ffi::DataType::F8E4M3FN && fp8 != ffi::DataType::F8E5M2) {
      return Invalid("results must be f8e4m3fn or f8e5m2");
    }
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
  a.fp8_type = fp8 == ffi::DataType::F8E5M2 ? Fp8Type::kE5M2 : Fp8Type::kE4M3FN;
  if (a.batch == 0 || a.rows == 0 || a.cols == 0) return ffi::Error::Success();
  if (!BlockQuantizeSupports(a.batch, a.rows, a.cols)) {
    return Invalid("sizes not supported: " + Shape(dims));
  }
  const cudaError_t err = LaunchBlockQuantize(stream, a);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(kName) + "CUDA launch failed: " +
                                cudaGetErrorString(err));
  }
  return ffi::Error::Success();
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
