#pragma once
// One configuration of jax_fp8_grouped_gemm's kernel (grouped_gemm.h): grouped_sm90.cuh's
// FP8 ptr-array grouped GEMM on per-group problems (M, N, K) = (size_g, n, k): A_g = the
// group's rows of lhs, B_g = rhs[g] [n, k], D_g = the group's rows of out, alpha_g read per
// group from device memory (CUTLASS's per-group alpha pointer array). Included by one .cu
// file per operand / output type.
//
// Before it, GroupedGemmSetupKernel turns group_sizes into CUTLASS's per-group arrays on
// the device, and GroupedGemmZeroKernel zeroes the output rows past the groups.
#include "grouped_gemm.h"
#include "grouped_sm90.cuh"

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

template <class Arrays>
__global__ void __launch_bounds__(kSetupThreads)
    GroupedGemmSetupKernel(GroupedGemmCall c, Arrays a) {
  using Shape3 = typename Arrays::Shape3;
  ForEachGroupRows(
      c.group_sizes, c.groups, c.m, a.rows, [&](int64_t g, int64_t start, int64_t end) {
        if (g >= c.groups) return;
        a.shapes[g] =
            Shape3{static_cast<int>(end - start), static_cast<int>(c.n), static_cast<int>(c.k)};
        a.ptr_a[g] = static_cast<const typename Arrays::ElementA*>(c.lhs) + start * c.k;
        a.ptr_b[g] = static_cast<const typename Arrays::ElementB*>(c.rhs) + g * c.n * c.k;
        a.ptr_d[g] = static_cast<typename Arrays::ElementD*>(c.out) + start * c.n;
        a.stride_a[g] = PackedStride<typename Arrays::StrideA>(c.k);
        a.stride_b[g] = PackedStride<typename Arrays::StrideB>(c.k);
        a.stride_d[g] = PackedStride<typename Arrays::StrideD>(c.n);
        a.alpha[g] = c.lhs_scale_inv[g] * c.rhs_scale_inv[g];
        a.alpha_ptr[g] = a.alpha + g;
      });
}

template <class ElementA, class ElementD, class ElementB = cutlass::float_e4m3_t>
struct GroupedGemm {
  using Base = Fp8PtrArrayGemm<ElementA, ElementB, ElementD>;

  static int Prepare(int32_t device) { return Base::Prepare(device); }

  static int Run(const GroupedGemmCall& c, int32_t device, cudaStream_t stream) {
    if (int err = Base::Prepare(device)) return err;
    if (c.m == 0 || c.n == 0) return 0;
    return Base::Run(c, /*alpha_per_group=*/true, device, stream, [&](auto& a) -> int {
      GroupedGemmSetupKernel<<<1, kSetupThreads, 0, stream>>>(c, a);
      if (cudaError_t err = cudaGetLastError()) return err;
      return ZeroRowsPastGroups<ElementD>(c.out, a.rows, c.m, c.n,
                                          Base::OnDevice::hw[device].sm_count, stream);
    });
  }
};

}  // namespace
}  // namespace sm90
}  // namespace jax_fp8

// Defines `extern const GroupedGemmConfig <symbol>` for one instantiation.
#define JAX_FP8_GROUPED_GEMM_CONFIG(symbol, name, lhs_e5m2, out_bf16, ElementA, ElementD) \
  namespace jax_fp8 {                                                                     \
  using symbol##_t = sm90::GroupedGemm<ElementA, ElementD>;                               \
  extern const GroupedGemmConfig symbol;                                                  \
  const GroupedGemmConfig symbol{name, lhs_e5m2, out_bf16, &symbol##_t::Prepare,          \
                                 &symbol##_t::Run};                                       \
  }
