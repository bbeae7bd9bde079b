// XLA FFI handler "jax_fp8_grouped_gemm" (see grouped_gemm_cuda.h): decodes and checks the
// call strictly (types, shapes, the limits of grouped_gemm_limits.h, the workspace's size,
// 16-byte aligned buffers), then runs the CUTLASS configuration compiled for its types
// (grouped_gemm_sm90_*.cu). jax_fp8 emits the call only where those checks pass and the
// module was built with CUTLASS; anything else is an error here, never a silent result.
#include "grouped_gemm_cuda.h"

#include <cstdint>
#include <string>

#include "cuda_handler_util.h"
#include "grouped_gemm.h"
#include "grouped_gemm_limits.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

constexpr const char* kName = "jax_fp8_grouped_gemm";

ffi::Error Invalid(const std::string& msg) { return InvalidArgument(kName, msg); }

bool Fp8(ffi::DataType t) { return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2; }

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

struct Call {
  GroupedGemmCall c;
  int config;
};

ffi::ErrorOr<Call> Decode(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                          ffi::AnyBuffer lhs_scale_inv, ffi::AnyBuffer rhs_scale_inv,
                          ffi::Result<ffi::AnyBuffer>& out,
                          ffi::Result<ffi::AnyBuffer>& workspace) {
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
  if (workspace->element_type() != ffi::DataType::U8 || workspace->dimensions().size() != 1 ||
      workspace->dimensions()[0] != need) {
    return ffi::Unexpected(Invalid("the workspace must be uint8[" + std::to_string(need) + "]"));
  }
  if (!Aligned16(lhs.untyped_data()) || !Aligned16(rhs.untyped_data()) ||
      !Aligned16(out->untyped_data()) || !Aligned16(workspace->untyped_data())) {
    return ffi::Unexpected(Invalid("lhs, rhs, out and the workspace must be 16-byte aligned"));
  }
  const int config =
      GroupedGemmFind(lhs.element_type() == ffi::DataType::F8E5M2, ot == ffi::DataType::BF16);
  if (config < 0) {
    return ffi::Unexpected(Invalid(
        "no kernel compiled for these types (the module was built without CUTLASS's headers, "
        "or JAX_FP8_CUTLASS=OFF)"));
  }
  Call call{};
  call.c = GroupedGemmCall{m,
                           n,
                           k,
                           g,
                           lhs.untyped_data(),
                           rhs.untyped_data(),
                           static_cast<const int32_t*>(group_sizes.untyped_data()),
                           static_cast<const float*>(lhs_scale_inv.untyped_data()),
                           static_cast<const float*>(rhs_scale_inv.untyped_data()),
                           out->untyped_data(),
                           workspace->untyped_data(),
                           static_cast<size_t>(need)};
  call.config = config;
  return call;
}

ffi::Error GroupedGemmInitialize(cudaStream_t, int32_t device, ffi::AnyBuffer lhs,
                                 ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                                 ffi::AnyBuffer lhs_scale_inv, ffi::AnyBuffer rhs_scale_inv,
                                 ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Result<ffi::AnyBuffer> workspace) {
  auto call = Decode(lhs, rhs, group_sizes, lhs_scale_inv, rhs_scale_inv, out, workspace);
  if (!call.has_value()) return call.error();
  const int err = GroupedGemmConfigAt(call->config).prepare(device);
  if (err != 0) {
    return ffi::Error::Internal(std::string(kName) + ": CUTLASS setup failed: " +
                                cudaGetErrorString(static_cast<cudaError_t>(err)));
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer lhs,
                              ffi::AnyBuffer rhs, ffi::AnyBuffer group_sizes,
                              ffi::AnyBuffer lhs_scale_inv, ffi::AnyBuffer rhs_scale_inv,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace) {
  auto call = Decode(lhs, rhs, group_sizes, lhs_scale_inv, rhs_scale_inv, out, workspace);
  if (!call.has_value()) return call.error();
  const int err = GroupedGemmConfigAt(call->config).run(call->c, device, stream);
  if (err < 0) {
    return ffi::Error::Internal(std::string(kName) +
                                ": CUTLASS cannot implement this grouped GEMM (or its workspace "
                                "is short of grouped_gemm_workspace.h's budget)");
  }
  return LaunchStatus(kName, static_cast<cudaError_t>(err));
}

}  // namespace

#define JAX_FP8_GROUPED_GEMM_BINDING(stage)     \
  ffi::Ffi::Bind<stage>()                       \
      .Ctx<ffi::PlatformStream<cudaStream_t>>() \
      .Ctx<ffi::DeviceOrdinal>()                \
      .Arg<ffi::AnyBuffer>()                    \
      .Arg<ffi::AnyBuffer>()                    \
      .Arg<ffi::AnyBuffer>()                    \
      .Arg<ffi::AnyBuffer>()                    \
      .Arg<ffi::AnyBuffer>()                    \
      .Ret<ffi::AnyBuffer>()                    \
      .Ret<ffi::AnyBuffer>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8GroupedGemmInitializeCuda, GroupedGemmInitialize,
                              JAX_FP8_GROUPED_GEMM_BINDING(ffi::ExecutionStage::kInitialize));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8GroupedGemmCuda, GroupedGemmExecute,
                              JAX_FP8_GROUPED_GEMM_BINDING(ffi::ExecutionStage::kExecute),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
