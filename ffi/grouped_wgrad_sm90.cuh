#pragma once
// One configuration of jax_fp8_grouped_wgrad's kernel (grouped_wgrad.h): the FP8 grouped
// GEMM of grouped_sm90.cuh (CUTLASS's SM90 ptr-array grouped GEMM, the FP8 mainloop that
// promotes into float32, alpha_g per group in the epilogue) on per-group problems
// (M, N, K) = (k, n, ceil16(size_g)): A_g = lhs_t + pstart_g (row-major [k, K], row stride
// mp), B_g = grad_t + pstart_g (column-major [K, n]: each of the n rows of grad_t holds the
// group's tokens contiguous, stride mp), D_g = out + g * k * n (row-major [k, n]); the
// columns past the group's tokens up to ceil16(size_g) are 0.
// Included by one .cu file per operand / output type.
//
// Before it, GroupedWgradSetupKernel turns group_sizes into CUTLASS's per-group arrays on
// the device (no host synchronization, so the custom call can be captured in a CUDA graph).
// Every group writes its whole out[g]: an empty group's problem reads the 16 zero columns at
// the end of the padded operands (K = 16), so its output is alpha_g * 0 from the same
// epilogue, not a contraction of length 0.
#include "grouped_sm90.cuh"
#include "grouped_wgrad.h"

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

// Group g's tokens (ForEachGroupRows: sizes clamped to [0, m], their saturating prefix sums)
// and the columns of the padded operands: pstart_g = sum over h < g of ceil16(size_h) (a
// second scan, not saturating: at most m + 15 * groups <= mp - 16, the handler checks
// m <= mp - 16 * (groups + 1)).
template <class Arrays>
__global__ void __launch_bounds__(kSetupThreads)
    GroupedWgradSetupKernel(GroupedWgradCall c, Arrays a) {
  using Shape3 = typename Arrays::Shape3;
  __shared__ int64_t padded[kSetupThreads];
  __shared__ int64_t padded_carry;
  const int t = threadIdx.x;
  const int64_t zero_column = c.mp - 16;
  if (t == 0) padded_carry = 0;
  ForEachGroupRows(
      c.group_sizes, c.groups, c.m, a.rows, [&](int64_t g, int64_t start, int64_t end) {
        const int64_t size = end - start;
        const int64_t padded_size = (size + 15) / 16 * 16;
        padded[t] = padded_size;
        __syncthreads();
        for (int d = 1; d < kSetupThreads; d <<= 1) {
          const int64_t add = t >= d ? padded[t - d] : 0;
          __syncthreads();
          padded[t] += add;
          __syncthreads();
        }
        const int64_t pstart = padded_carry + (t == 0 ? 0 : padded[t - 1]);
        if (g < c.groups) {
          // K = ceil16(size): the group's padding columns are 0, so the contraction is the
          // same and every group's K is a multiple of 16 FP8 values (16 bytes), the operands'
          // alignment; an empty group reads the last 16 columns, which are 0.
          const int64_t column = size > 0 ? pstart : zero_column;
          a.shapes[g] = Shape3{static_cast<int>(c.k), static_cast<int>(c.n),
                               static_cast<int>(size > 0 ? padded_size : 16)};
          a.ptr_a[g] = static_cast<const typename Arrays::ElementA*>(c.lhs_t) + column;
          a.ptr_b[g] = static_cast<const typename Arrays::ElementB*>(c.grad_t) + column;
          a.ptr_d[g] = static_cast<typename Arrays::ElementD*>(c.out) + g * c.k * c.n;
          a.stride_a[g] = PackedStride<typename Arrays::StrideA>(c.mp);
          a.stride_b[g] = PackedStride<typename Arrays::StrideB>(c.mp);
          a.stride_d[g] = PackedStride<typename Arrays::StrideD>(c.n);
          a.alpha[g] = c.lhs_scale_inv[g] * c.grad_scale_inv[g];
          a.alpha_ptr[g] = a.alpha + g;
        }
        // Every thread has read padded_carry (ForEachGroupRows synchronizes the block again
        // before the next chunk).
        __syncthreads();
        if (t == kSetupThreads - 1) padded_carry += padded[t];
      });
}

// The weight gradient of one operand / output type: the grouped GEMM's CUTLASS kernel
// (Fp8PtrArrayGemm: E4M3 A, ElementB B, both K-major), its per-device preparation and
// workspace layout.
template <class ElementA, class ElementB, class ElementD>
struct GroupedWgrad {
  using Base = Fp8PtrArrayGemm<ElementA, ElementB, ElementD>;

  static int Prepare(int32_t device) { return Base::Prepare(device); }

  static int Run(const GroupedWgradCall& c, int32_t device, cudaStream_t stream) {
    if (int err = Base::Prepare(device)) return err;
    if (c.k == 0 || c.n == 0 || c.groups == 0) return 0;
    return Base::Run(c, /*alpha_per_group=*/true, device, stream, [&](auto& a) -> int {
      GroupedWgradSetupKernel<<<1, kSetupThreads, 0, stream>>>(c, a);
      return static_cast<int>(cudaGetLastError());
    });
  }
};

}  // namespace
}  // namespace sm90
}  // namespace jax_fp8

// Defines `extern const GroupedWgradConfig <symbol>` for one instantiation.
#define JAX_FP8_GROUPED_WGRAD_CONFIG(symbol, name, grad_e5m2, out_bf16, ElementB, ElementD) \
  namespace jax_fp8 {                                                                       \
  using symbol##_t = sm90::GroupedWgrad<cutlass::float_e4m3_t, ElementB, ElementD>;         \
  extern const GroupedWgradConfig symbol;                                                   \
  const GroupedWgradConfig symbol{name, grad_e5m2, out_bf16, &symbol##_t::Prepare,          \
                                  &symbol##_t::Run};                                        \
  }
