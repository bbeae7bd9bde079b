#pragma once
// One configuration of jax_fp8_ragged_dot's kernel (ragged_dot.h): CUTLASS's SM90 ptr-array
// grouped GEMM on 16-bit operands (TMA loads of K-major or MN-major tiles, warp-specialized
// cooperative wgmma mainloop accumulating in float32, persistent group tile scheduler, TMA
// epilogue out = accumulator, rounded once). 16-bit wgmma reads either operand MN-major, so
// no product needs a transposed copy of an operand: only each group's pointers, shape and
// strides differ between the three products.
//
// Per group g (rows [start, end) of the token axis), CUTLASS's problem (M, N, K) and operands:
//   kForward    (size, n, k): A = lhs + start * k (row-major [size, k]), B = rhs[g] [k, n]
//               (N contiguous: "row-major B"), D = out + start * n;
//   kTransposed (size, n, k): A as kForward, B = rhs[g] [n, k] (K contiguous), D as kForward;
//   kWeightGrad (k, n, size): A = lhs + start * k read as [k, size] (M contiguous, row stride
//               k), B = rhs + start * n read as [size, n] (N contiguous), D = out[g] [k, n].
// TMA zero-fills past each group's extent, so a group's tiles never read another's rows.
// kWeightGrad's empty groups get M = 0 (no tiles: CUTLASS's mainloop leaves the accumulators
// of a contraction of length 0 unwritten) and their out[g] is zeroed by a kernel of its own.
//
// Before the GEMM, RaggedDotSetupKernel turns group_sizes into CUTLASS's per-group arrays on
// the device (no host synchronization, so the custom call can be captured in a CUDA graph).
// Included by one .cu file per product and type.
#include "grouped_sm90.cuh"
#include "ragged_dot.h"

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

template <int kMode, class Arrays>
__global__ void __launch_bounds__(kSetupThreads) RaggedDotSetupKernel(RaggedDotCall c, Arrays a) {
  using Shape3 = typename Arrays::Shape3;
  using EA = typename Arrays::ElementA;
  using EB = typename Arrays::ElementB;
  ForEachGroupRows(
      c.group_sizes, c.groups, c.m, a.rows, [&](int64_t g, int64_t start, int64_t end) {
        if (g >= c.groups) return;
        const int size = static_cast<int>(end - start);
        const int k = static_cast<int>(c.k), n = static_cast<int>(c.n);
        a.ptr_a[g] = static_cast<const EA*>(c.lhs) + start * c.k;
        a.stride_a[g] = PackedStride<typename Arrays::StrideA>(c.k);
        a.stride_d[g] = PackedStride<typename Arrays::StrideD>(c.n);
        if constexpr (kMode == kRaggedWeightGrad) {
          a.shapes[g] = Shape3{size > 0 ? k : 0, n, size};
          a.ptr_b[g] = static_cast<const EB*>(c.rhs) + start * c.n;
          a.ptr_d[g] = static_cast<typename Arrays::ElementD*>(c.out) + g * c.k * c.n;
          a.stride_b[g] = PackedStride<typename Arrays::StrideB>(c.n);
        } else {
          a.shapes[g] = Shape3{size, n, k};
          a.ptr_b[g] = static_cast<const EB*>(c.rhs) + g * c.n * c.k;
          a.ptr_d[g] = static_cast<typename Arrays::ElementD*>(c.out) + start * c.n;
          a.stride_b[g] =
              PackedStride<typename Arrays::StrideB>(kMode == kRaggedForward ? c.n : c.k);
        }
      });
}

// kWeightGrad: out[g] = 0 for each empty group (M = 0 in its problem shape), 16 bytes a
// store; blockIdx.y strides over the groups.
template <class Shape3>
__global__ void RaggedDotZeroEmptyKernel(uint4* out, const Shape3* shapes, int64_t groups,
                                         int64_t group_vectors) {
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    if (cute::get<0>(shapes[g]) != 0) continue;
    uint4* dst = out + g * group_vectors;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < group_vectors;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[i] = make_uint4(0, 0, 0, 0);
    }
  }
}

template <int kMode, class Element, class ElementD>
struct RaggedDot {
  using Base =
      PtrArrayGemm<Element,
                   std::conditional_t<kMode == kRaggedWeightGrad, cutlass::layout::ColumnMajor,
                                      cutlass::layout::RowMajor>,
                   Element,
                   std::conditional_t<kMode == kRaggedTransposed, cutlass::layout::ColumnMajor,
                                      cutlass::layout::RowMajor>,
                   ElementD, Shape<_128, _128, _64>>;

  static int Prepare(int32_t device) { return Base::Prepare(device); }

  static int Run(const RaggedDotCall& c, int32_t device, cudaStream_t stream) {
    if (int err = Base::Prepare(device)) return err;
    const bool wgrad = kMode == kRaggedWeightGrad;
    if (c.k == 0 || c.n == 0 || (!wgrad && c.m == 0)) return 0;
    return Base::Run(c, /*alpha_per_group=*/false, device, stream, [&](auto& a) -> int {
      RaggedDotSetupKernel<kMode><<<1, kSetupThreads, 0, stream>>>(c, a);
      if (cudaError_t err = cudaGetLastError()) return err;
      if constexpr (kMode == kRaggedWeightGrad) {
        const int64_t group_vectors = c.k * c.n * static_cast<int64_t>(sizeof(ElementD)) / 16;
        const int64_t per_group = (group_vectors + 255) / 256;
        const dim3 grid(static_cast<unsigned>(per_group < 8 ? per_group : 8),
                        static_cast<unsigned>(c.groups < 65535 ? c.groups : 65535));
        RaggedDotZeroEmptyKernel<<<grid, 256, 0, stream>>>(static_cast<uint4*>(c.out), a.shapes,
                                                           c.groups, group_vectors);
        return static_cast<int>(cudaGetLastError());
      } else {
        return ZeroRowsPastGroups<ElementD>(c.out, a.rows, c.m, c.n,
                                            Base::OnDevice::hw[device].sm_count, stream);
      }
    });
  }
};

}  // namespace
}  // namespace sm90
}  // namespace jax_fp8

// Defines `extern const RaggedDotConfig <symbol>` for one instantiation.
#define JAX_FP8_RAGGED_DOT_CONFIG(symbol, name, mode, in_f16, out_float, Element, ElementD) \
  namespace jax_fp8 {                                                                       \
  using symbol##_t = sm90::RaggedDot<mode, Element, ElementD>;                              \
  extern const RaggedDotConfig symbol;                                                      \
  const RaggedDotConfig symbol{                                                             \
      name, mode, in_f16, out_float, &symbol##_t::Prepare, &symbol##_t::Run};               \
  }
