// XLA FFI handler "jax_fp8_grouped_wgrad" (see grouped_wgrad_cuda.h): decodes and checks the
// call strictly (types, shapes, the limits of grouped_wgrad_limits.h, the workspace's size,
// 16-byte aligned buffers), then runs the CUTLASS configuration compiled for its types
// (grouped_wgrad_sm90_*.cu) through cutlass_handler.h's stages. jax_fp8 emits the call only
// where those checks pass and the module was built with CUTLASS; anything else is an error
// here, never a silent result.
#include "grouped_wgrad_cuda.h"

#include <cstdint>
#include <string>

#include "cuda_handler_util.h"
#include "cutlass_handler.h"
#include "grouped_gemm_workspace.h"
#include "grouped_wgrad.h"
#include "grouped_wgrad_limits.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

constexpr char kName[] = "jax_fp8_grouped_wgrad";

ffi::Error Invalid(const std::string& msg) { return InvalidArgument(kName, msg); }

using Call = CutlassCall<GroupedWgradCall>;

ffi::ErrorOr<Call> Decode(ffi::AnyBuffer lhs_t, ffi::AnyBuffer grad_t, ffi::AnyBuffer group_sizes,
                          ffi::AnyBuffer lhs_scale_inv, ffi::AnyBuffer grad_scale_inv,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                          int64_t m) {
  const auto ld = lhs_t.dimensions(), gd = grad_t.dimensions(), od = out->dimensions();
  const std::string shapes = "need lhs_t [K, Mp], grad_t [N, Mp] and out [G, K, N], got lhs_t " +
                             ShapeString(ld) + ", grad_t " + ShapeString(gd) + ", out " +
                             ShapeString(od);
  if (ld.size() != 2 || gd.size() != 2 || od.size() != 3) {
    return ffi::Unexpected(Invalid(shapes));
  }
  const int64_t k = ld[0], mp = ld[1], n = gd[0], g = od[0];
  if (gd[1] != mp || od[1] != k || od[2] != n) return ffi::Unexpected(Invalid(shapes));
  const ffi::DataType lt = lhs_t.element_type(), gt = grad_t.element_type();
  const ffi::DataType ot = out->element_type();
  if (lt != ffi::DataType::F8E4M3FN ||
      (gt != ffi::DataType::F8E4M3FN && gt != ffi::DataType::F8E5M2)) {
    return ffi::Unexpected(Invalid("lhs_t must be f8e4m3fn and grad_t f8e4m3fn or f8e5m2"));
  }
  if (ot != ffi::DataType::BF16 && ot != ffi::DataType::F32) {
    return ffi::Unexpected(Invalid("out must be bf16 or f32"));
  }
  auto vector = [g](ffi::AnyBuffer b, ffi::DataType t) {
    return b.element_type() == t && b.dimensions().size() == 1 && b.dimensions()[0] == g;
  };
  if (!vector(group_sizes, ffi::DataType::S32)) {
    return ffi::Unexpected(
        Invalid("group_sizes must be int32[G], G = out.shape[0] = " + std::to_string(g) + ", got " +
                ShapeString(group_sizes.dimensions())));
  }
  if (!vector(lhs_scale_inv, ffi::DataType::F32) || !vector(grad_scale_inv, ffi::DataType::F32)) {
    return ffi::Unexpected(
        Invalid("lhs_scale_inv and grad_scale_inv must be float32[G], G = " + std::to_string(g)));
  }
  if (!GroupedWgradSupports(lt, gt, ot, k, n, mp, g)) {
    return ffi::Unexpected(
        Invalid("this weight gradient is outside the kernel's limits (grouped_wgrad_limits.h: E4M3 "
                "lhs x E4M3 or E5M2 grad, Mp % 16 == 0 and Mp >= 16 * (G + 1), N % 8 (bf16 out) or "
                "N % 4 (f32 out) == 0, 1 <= G <= 2^20, K, N >= 1, sizes below 2^31), got " +
                shapes));
  }
  if (m < 0 || m > mp - 16 * (g + 1)) {
    return ffi::Unexpected(Invalid("the rows m = " + std::to_string(m) +
                                   " must lie in [0, Mp - 16 * (G + 1)] = [0, " +
                                   std::to_string(mp - 16 * (g + 1)) + "]"));
  }
  const int64_t need = GroupedGemmWorkspaceBytes(g);
  if (!WorkspaceIs(*workspace, need)) {
    return ffi::Unexpected(Invalid("the workspace must be uint8[" + std::to_string(need) + "]"));
  }
  if (!Aligned16({lhs_t.untyped_data(), grad_t.untyped_data(), out->untyped_data(),
                  workspace->untyped_data()})) {
    return ffi::Unexpected(Invalid("lhs_t, grad_t, out and the workspace must be 16-byte aligned"));
  }
  const int config = GroupedWgradFind(gt == ffi::DataType::F8E5M2, ot == ffi::DataType::BF16);
  if (config < 0) {
    return ffi::Unexpected(Invalid(
        "no kernel compiled for these types (the module was built without CUTLASS's headers, "
        "or JAX_FP8_CUTLASS=OFF)"));
  }
  return Call{
      GroupedWgradCall{m, k, n, mp, g, lhs_t.untyped_data(), grad_t.untyped_data(),
                       static_cast<const int32_t*>(group_sizes.untyped_data()),
                       static_cast<const float*>(lhs_scale_inv.untyped_data()),
                       static_cast<const float*>(grad_scale_inv.untyped_data()),
                       out->untyped_data(), workspace->untyped_data(), static_cast<size_t>(need)},
      config};
}

using Handler = CutlassHandler<kName, GroupedWgradConfigAt, Decode>;

}  // namespace

JAX_FP8_DEFINE_CUDA_HANDLER_BUNDLE(JaxFp8GroupedWgradCuda, Handler::Execute,
                                   JaxFp8GroupedWgradInitializeCuda, Handler::Initialize,
                                   .Arg<ffi::AnyBuffer>()      // lhs_t
                                       .Arg<ffi::AnyBuffer>()  // grad_t
                                       .Arg<ffi::AnyBuffer>()  // group_sizes
                                       .Arg<ffi::AnyBuffer>()  // lhs_scale_inv
                                       .Arg<ffi::AnyBuffer>()  // grad_scale_inv
                                       .Ret<ffi::AnyBuffer>()  // out
                                       .Ret<ffi::AnyBuffer>()  // workspace
                                       .Attr<int64_t>("m"));

}  // namespace jax_fp8
