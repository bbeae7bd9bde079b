// XLA FFI handler "jax_fp8_ragged_dot" (see ragged_dot_cuda.h): decodes and checks the call
// strictly (mode, types, shapes, the limits of ragged_dot_limits.h, the workspace's size,
// 16-byte aligned buffers), then runs the CUTLASS configuration compiled for its product and
// types (ragged_dot_sm90_*.cu) through cutlass_handler.h's stages. jax_fp8 emits the call only
// where those checks pass and the module was built with CUTLASS; anything else is an error
// here, never a silent result.
#include "ragged_dot_cuda.h"

#include <cstdint>
#include <string>

#include "cuda_handler_util.h"
#include "cutlass_handler.h"
#include "grouped_gemm_workspace.h"
#include "ragged_dot.h"
#include "ragged_dot_limits.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

constexpr char kName[] = "jax_fp8_ragged_dot";

ffi::Error Invalid(const std::string& msg) { return InvalidArgument(kName, msg); }

using Call = CutlassCall<RaggedDotCall>;

// The shapes each mode takes, in words, for the error messages.
const char* ShapesOf(int64_t mode) {
  switch (mode) {
    case kRaggedForward: return "lhs [M, K], rhs [G, K, N] and out [M, N]";
    case kRaggedTransposed: return "lhs [M, K], rhs [G, N, K] and out [M, N]";
    default: return "lhs [M, K], rhs [M, N] and out [G, K, N]";
  }
}

ffi::ErrorOr<Call> Decode(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                          int64_t mode) {
  if (mode != kRaggedForward && mode != kRaggedTransposed && mode != kRaggedWeightGrad) {
    return ffi::Unexpected(Invalid("mode must be 0, 1 or 2, got " + std::to_string(mode)));
  }
  const auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  const std::string shapes = std::string("need ") + ShapesOf(mode) + ", got lhs " +
                             ShapeString(ld) + ", rhs " + ShapeString(rd) + ", out " +
                             ShapeString(od);
  const bool wgrad = mode == kRaggedWeightGrad;
  if (ld.size() != 2 || rd.size() != (wgrad ? 2u : 3u) || od.size() != (wgrad ? 3u : 2u)) {
    return ffi::Unexpected(Invalid(shapes));
  }
  int64_t m = ld[0], k = ld[1], n, g;
  bool fits;
  if (mode == kRaggedForward) {
    g = rd[0];
    n = rd[2];
    fits = rd[1] == k && od[0] == m && od[1] == n;
  } else if (mode == kRaggedTransposed) {
    g = rd[0];
    n = rd[1];
    fits = rd[2] == k && od[0] == m && od[1] == n;
  } else {
    g = od[0];
    n = rd[1];
    fits = rd[0] == m && od[1] == k && od[2] == n;
  }
  if (!fits) return ffi::Unexpected(Invalid(shapes));
  const ffi::DataType it = lhs.element_type(), ot = out->element_type();
  if (rhs.element_type() != it) {
    return ffi::Unexpected(Invalid("lhs and rhs must have one element type"));
  }
  if (group_sizes.element_type() != ffi::DataType::S32 || group_sizes.dimensions().size() != 1 ||
      group_sizes.dimensions()[0] != g) {
    return ffi::Unexpected(Invalid("group_sizes must be int32[G], G = " + std::to_string(g) +
                                   ", got " + ShapeString(group_sizes.dimensions())));
  }
  if (!RaggedDotSupports(static_cast<int>(mode), it, ot, m, k, n, g)) {
    return ffi::Unexpected(Invalid(
        "this grouped GEMM is outside the kernel's limits (ragged_dot_limits.h: bf16 "
        "operands, bf16 out or f32 for the weight gradient, K % 8 == 0, N % 8 == 0, 1 <= G <= "
        "2^20, sizes below 2^31), "
        "got " +
        shapes));
  }
  const int64_t need = GroupedGemmWorkspaceBytes(g);
  if (!WorkspaceIs(*workspace, need)) {
    return ffi::Unexpected(Invalid("the workspace must be uint8[" + std::to_string(need) + "]"));
  }
  if (!Aligned16({lhs.untyped_data(), rhs.untyped_data(), out->untyped_data(),
                  workspace->untyped_data()})) {
    return ffi::Unexpected(Invalid("lhs, rhs, out and the workspace must be 16-byte aligned"));
  }
  const int config =
      RaggedDotFind(static_cast<int>(mode), it == ffi::DataType::F16, ot == ffi::DataType::F32);
  if (config < 0) {
    return ffi::Unexpected(
        Invalid("no kernel compiled for this product and these types (the module was built without "
                "CUTLASS's headers, or JAX_FP8_CUTLASS=OFF)"));
  }
  return Call{
      RaggedDotCall{m, k, n, g, lhs.untyped_data(), rhs.untyped_data(),
                    static_cast<const int32_t*>(group_sizes.untyped_data()), out->untyped_data(),
                    workspace->untyped_data(), static_cast<size_t>(need)},
      config};
}

using Handler = CutlassHandler<kName, RaggedDotConfigAt, Decode>;

}  // namespace

JAX_FP8_DEFINE_CUDA_HANDLER_BUNDLE(JaxFp8RaggedDotCuda, Handler::Execute,
                                   JaxFp8RaggedDotInitializeCuda, Handler::Initialize,
                                   .Arg<ffi::AnyBuffer>()      // lhs
                                       .Arg<ffi::AnyBuffer>()  // rhs
                                       .Arg<ffi::AnyBuffer>()  // group_sizes
                                       .Ret<ffi::AnyBuffer>()  // out
                                       .Ret<ffi::AnyBuffer>()  // workspace
                                       .Attr<int64_t>("mode"));

}  // namespace jax_fp8
