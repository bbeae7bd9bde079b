// XLA FFI handler "jax_fp8_grouped_gemm" (see grouped_gemm_cuda.h): decodes and checks the
// call strictly (types, shapes, the limits of grouped_gemm_limits.h, the workspace's size,
// 16-byte aligned buffers), then runs the CUTLASS configuration compiled for its types
// (grouped_gemm_sm90_*.cu) through cutlass_handler.h's stages. jax_fp8 emits the call only
// where those checks pass and the module was built with CUTLASS; anything else is an error
// here, never a silent result.
#include "grouped_gemm_cuda.h"

#include <cstdint>
#include <string>

#include "cuda_handler_util.h"
#include "cutlass_handler.h"
#include "grouped_gemm.h"
#include "grouped_gemm_limits.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

constexpr char kName[] = "jax_fp8_grouped_gemm";

ffi::Error Invalid(const std::string& msg) { return InvalidArgument(kName, msg); }

bool Fp8(ffi::DataType t) { return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2; }

using Call = CutlassCall<GroupedGemmCall>;

ffi::ErrorOr<Call> Decode(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                          ffi::AnyBuffer lhs_scale_inv, ffi::AnyBuffer rhs_scale_inv,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace) {
  const auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  if (ld.size() != 2 || rd.size() != 3 || od.size() != 2) {
    return ffi::Unexpected(Invalid("need lhs [M, K], rhs [G, N, K] and out [M, N], got lhs " +
                                   ShapeString(ld) + ", rhs " + ShapeString(rd) + ", out " +
                                   ShapeString(od)));
  }
  const int64_t m = ld[0], k = ld[1], g = rd[0], n = rd[1];
  if (rd[2] != k || od[0] != m || od[1] != n) {
    return ffi::Unexpected(Invalid("need lhs [M, K], rhs [G, N, K] and out [M, N], got lhs " +
                                   ShapeString(ld) + ", rhs " + ShapeString(rd) + ", out " +
                                   ShapeString(od)));
  }
  if (!Fp8(lhs.element_type()) || !Fp8(rhs.element_type())) {
    return ffi::Unexpected(Invalid("lhs and rhs must be f8e4m3fn or f8e5m2"));
  }
  const ffi::DataType ot = out->element_type();
  if (ot != ffi::DataType::BF16 && ot != ffi::DataType::F32) {
    return ffi::Unexpected(Invalid("out must be bf16 or f32"));
  }
  auto vector = [g](ffi::AnyBuffer b, ffi::DataType t) {
    return b.element_type() == t && b.dimensions().size() == 1 && b.dimensions()[0] == g;
  };
  if (!vector(group_sizes, ffi::DataType::S32)) {
    return ffi::Unexpected(
        Invalid("group_sizes must be int32[G], G = rhs.shape[0] = " + std::to_string(g) + ", got " +
                ShapeString(group_sizes.dimensions())));
  }
  if (!vector(lhs_scale_inv, ffi::DataType::F32) || !vector(rhs_scale_inv, ffi::DataType::F32)) {
    return ffi::Unexpected(
        Invalid("lhs_scale_inv and rhs_scale_inv must be float32[G], G = " + std::to_string(g)));
  }
  if (!GroupedGemmSupports(lhs.element_type(), rhs.element_type(), ot, m, n, k, g)) {
    return ffi::Unexpected(
        Invalid("this grouped GEMM is outside the kernel's limits (grouped_gemm_limits.h: E4M3 or "
                "E5M2 lhs x E4M3 rhs, K % 16 == 0, N % 8 (bf16 out) or N % 4 (f32 out) == 0, "
                "1 <= G <= 2^20, sizes below 2^31), got lhs " +
                ShapeString(ld) + ", rhs " + ShapeString(rd)));
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
      GroupedGemmFind(lhs.element_type() == ffi::DataType::F8E5M2, ot == ffi::DataType::BF16);
  if (config < 0) {
    return ffi::Unexpected(Invalid(
        "no kernel compiled for these types (the module was built without CUTLASS's headers, "
        "or JAX_FP8_CUTLASS=OFF)"));
  }
  return Call{
      GroupedGemmCall{m, n, k, g, lhs.untyped_data(), rhs.untyped_data(),
                      static_cast<const int32_t*>(group_sizes.untyped_data()),
                      static_cast<const float*>(lhs_scale_inv.untyped_data()),
                      static_cast<const float*>(rhs_scale_inv.untyped_data()), out->untyped_data(),
                      workspace->untyped_data(), static_cast<size_t>(need)},
      config};
}

using Handler = CutlassHandler<kName, GroupedGemmConfigAt, Decode>;

}  // namespace

JAX_FP8_DEFINE_CUDA_HANDLER_BUNDLE(JaxFp8GroupedGemmCuda, Handler::Execute,
                                   JaxFp8GroupedGemmInitializeCuda, Handler::Initialize,
                                   .Arg<ffi::AnyBuffer>()        // lhs
                                       .Arg<ffi::AnyBuffer>()    // rhs
                                       .Arg<ffi::AnyBuffer>()    // group_sizes
                                       .Arg<ffi::AnyBuffer>()    // lhs_scale_inv
                                       .Arg<ffi::AnyBuffer>()    // rhs_scale_inv
                                       .Ret<ffi::AnyBuffer>()    // out
                                       .Ret<ffi::AnyBuffer>());  // workspace

}  // namespace jax_fp8
