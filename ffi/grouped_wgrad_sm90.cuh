#pragma once
// One configuration of jax_fp8_grouped_wgrad's kernel (grouped_wgrad.h): the grouped GEMM
// of grouped_gemm_sm90.cuh (CUTLASS's SM90 ptr-array grouped GEMM, the FP8 mainloop that
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
#include "grouped_gemm_sm90.cuh"
#include "grouped_wgrad.h"

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

// Group g's tokens: sizes clamped to [0, m] and their saturating (at m) prefix sums, as
// GroupedGemmSetupKernel computes them (one block, Hillis-Steele scans of kSetupThreads
// groups at a time, carries between chunks); and the columns of the padded operands:
// pstart_g = sum over h < g of ceil16(size_h) (a second scan, not saturating: at most
// m + 15 * groups <= mp - 16, the handler checks m <= mp - 16 * (groups + 1)).
template <class Shape3, class EA, class EB, class ED, class SA, class SB, class SD>
__global__ void __launch_bounds__(kSetupThreads)
    GroupedWgradSetupKernel(GroupedWgradCall c, GroupArrays<Shape3, EA, EB, ED, SA, SB, SD> a) {
  __shared__ int64_t scan[kSetupThreads];
  __shared__ int64_t padded[kSetupThreads];
  __shared__ int64_t carry, padded_carry;
  const int t = threadIdx.x;
  const int64_t cap = c.m;  // <= mp - 16 * (groups + 1) (grouped_wgrad_cuda.cc)
  const int64_t zero_column = c.mp - 16;
  if (t == 0) {
    carry = 0;
    padded_carry = 0;
  }
  __syncthreads();
  for (int64_t base = 0; base < c.groups; base += kSetupThreads) {
    const int64_t g = base + t;
    int64_t v = 0;
    if (g < c.groups) {
      const int64_t raw = c.group_sizes[g];
      v = raw < 0 ? 0 : (raw > cap ? cap : raw);
    }
    scan[t] = v;
    __syncthreads();
    for (int d = 1; d < kSetupThreads; d <<= 1) {
      const int64_t add = t >= d ? scan[t - d] : 0;
      __syncthreads();
      const int64_t s = scan[t] + add;
      scan[t] = s > cap ? cap : s;
      __syncthreads();
    }
    const int64_t before = t == 0 ? 0 : scan[t - 1];
    const int64_t start = carry + before > cap ? cap : carry + before;
    const int64_t end = carry + scan[t] > cap ? cap : carry + scan[t];
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
      a.ptr_a[g] = static_cast<const EA*>(c.lhs_t) + column;
      a.ptr_b[g] = static_cast<const EB*>(c.grad_t) + column;
      a.ptr_d[g] = static_cast<ED*>(c.out) + g * c.k * c.n;
      a.stride_a[g] = SA{c.mp, Int<1>{}, Int<0>{}};
      a.stride_b[g] = SB{c.mp, Int<1>{}, Int<0>{}};
      a.stride_d[g] = SD{c.n, Int<1>{}, Int<0>{}};
      a.alpha[g] = c.lhs_scale_inv[g] * c.grad_scale_inv[g];
      a.alpha_ptr[g] = a.alpha + g;
    }
    __syncthreads();
    if (t == kSetupThreads - 1) {
      carry = end;
      padded_carry += padded[t];
    }
    __syncthreads();
  }
  if (t == 0) *a.rows = carry;
}

// The weight gradient of one operand / output type: GroupedGemm's CUTLASS kernel (E4M3 A,
// ElementB B, both K-major), its per-device preparation and workspace layout.
template <class ElementA, class ElementB, class ElementD>
struct GroupedWgrad {
  using Base = GroupedGemm<ElementA, ElementD, ElementB>;
  using Gemm = typename Base::Gemm;
  using Kernel = typename Base::Kernel;
  using OnDevice = typename Base::OnDevice;

  static int Prepare(int32_t device) { return OnDevice::Prepare(device); }

  static int Run(const GroupedWgradCall& c, int32_t device, cudaStream_t stream) {
    if (int err = OnDevice::Prepare(device)) return err;
    if (c.k == 0 || c.n == 0 || c.groups == 0) return 0;
    typename Base::Arrays a;
    const size_t arrays = Base::Carve(c.workspace, c.groups, &a);
    if (arrays > c.workspace_bytes) return -1;

    GroupedWgradSetupKernel<<<1, kSetupThreads, 0, stream>>>(c, a);
    if (cudaError_t err = cudaGetLastError()) return err;

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(c.groups), a.shapes, nullptr};  // on the device only
    args.mainloop = {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 0.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = a.alpha_ptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {_0{}, _0{}, 1};
    fusion.dBeta = {_0{}, _0{}, 0};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = a.stride_d;
    args.epilogue.ptr_D = a.ptr_d;
    args.epilogue.dD = a.stride_d;
    args.hw_info = OnDevice::hw[device];

    void* cutlass_workspace = static_cast<char*>(c.workspace) + arrays;
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return -1;
    if (Gemm::get_workspace_size(args) > c.workspace_bytes - arrays) return -1;
    if (Kernel::initialize_workspace(args, cutlass_workspace, stream) !=
        cutlass::Status::kSuccess) {
      return cudaErrorUnknown;
    }
    const typename Kernel::Params params = Kernel::to_underlying_arguments(args, cutlass_workspace);
    return OnDevice::Launch(params, stream);
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
