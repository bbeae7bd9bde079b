#pragma once
// One configuration of jax_fp8_grouped_gemm's kernel (grouped_gemm.h): CUTLASS's SM90
// ptr-array grouped GEMM (TMA loads with per-group descriptors rewritten on the device,
// warp-specialized cooperative wgmma mainloop with CUTLASS's FP8 promotion into float32,
// persistent group tile scheduler) and a TMA epilogue out = alpha_g * accumulator, alpha_g
// read per group from device memory (CUTLASS's per-group alpha pointer array), no source
// tensor. Included by one .cu file per operand / output type.
//
// Before it, GroupedGemmSetupKernel turns group_sizes into CUTLASS's per-group arrays on
// the device (no host synchronization, so the custom call can be captured in a CUDA
// graph), and GroupedGemmZeroKernel zeroes the output rows past the groups.

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "cutlass_launch.cuh"
#include "grouped_gemm.h"
#include "grouped_gemm_workspace.h"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the grouped GEMM needs CUDA >= 12.3 (modifiable TMA descriptors on SM90)"
#endif

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

using namespace cute;

constexpr int kSetupThreads = 256;

// The device-side arrays of one call, carved out of the workspace.
template <class Shape3, class EA, class EB, class ED, class SA, class SB, class SD>
struct GroupArrays {
  int64_t* rows;  // the rows the groups cover (sum of the clamped sizes)
  Shape3* shapes;
  const EA** ptr_a;
  const EB** ptr_b;
  ED** ptr_d;
  SA* stride_a;
  SB* stride_b;
  SD* stride_d;
  float* alpha;
  const float** alpha_ptr;
};

// Group g's rows [start, end): the saturating (at m) prefix sums of the sizes clamped to
// [0, m], computed by one block (Hillis-Steele scan of kSetupThreads sizes at a time, the
// carry between chunks saturating too: min(a + b, m) is associative on [0, m]).
template <class Shape3, class EA, class EB, class ED, class SA, class SB, class SD>
__global__ void __launch_bounds__(kSetupThreads)
    GroupedGemmSetupKernel(GroupedGemmCall c, GroupArrays<Shape3, EA, EB, ED, SA, SB, SD> a) {
  __shared__ int64_t scan[kSetupThreads];
  __shared__ int64_t carry;
  const int t = threadIdx.x;
  if (t == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < c.groups; base += kSetupThreads) {
    const int64_t g = base + t;
    int64_t v = 0;
    if (g < c.groups) {
      const int64_t raw = c.group_sizes[g];
      v = raw < 0 ? 0 : (raw > c.m ? c.m : raw);
    }
    scan[t] = v;
    __syncthreads();
    for (int d = 1; d < kSetupThreads; d <<= 1) {
      const int64_t add = t >= d ? scan[t - d] : 0;
      __syncthreads();
      const int64_t s = scan[t] + add;
      scan[t] = s > c.m ? c.m : s;
      __syncthreads();
    }
    const int64_t before = t == 0 ? 0 : scan[t - 1];
    const int64_t start = carry + before > c.m ? c.m : carry + before;
    const int64_t end = carry + scan[t] > c.m ? c.m : carry + scan[t];
    if (g < c.groups) {
      a.shapes[g] =
          Shape3{static_cast<int>(end - start), static_cast<int>(c.n), static_cast<int>(c.k)};
      a.ptr_a[g] = static_cast<const EA*>(c.lhs) + start * c.k;
      a.ptr_b[g] = static_cast<const EB*>(c.rhs) + g * c.n * c.k;
      a.ptr_d[g] = static_cast<ED*>(c.out) + start * c.n;
      a.stride_a[g] = SA{c.k, Int<1>{}, Int<0>{}};
      a.stride_b[g] = SB{c.k, Int<1>{}, Int<0>{}};
      a.stride_d[g] = SD{c.n, Int<1>{}, Int<0>{}};
      a.alpha[g] = c.lhs_scale_inv[g] * c.rhs_scale_inv[g];
      a.alpha_ptr[g] = a.alpha + g;
    }
    __syncthreads();
    if (t == kSetupThreads - 1) carry = end;
    __syncthreads();
  }
  if (t == 0) *a.rows = carry;
}

// Zeroes out[rows:m, :] (rows read from the setup kernel's result), 16 bytes a store: rows
// are multiples of 16 bytes (grouped_gemm_limits.h) and the buffer 16-byte aligned. A
// template (on the output type) so that each configuration's unit may define it.
template <class ElementD>
__global__ void GroupedGemmZeroKernel(uint4* out, const int64_t* rows, int64_t row_vectors,
                                      int64_t m) {
  const int64_t first = *rows * row_vectors, last = m * row_vectors;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < last;
       i += stride) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

inline size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The arrays of `groups` groups at the front of the workspace (from its first 128-byte
// boundary), then CUTLASS's workspace (128-byte aligned, as its TMA descriptors need);
// returns the bytes before CUTLASS's workspace.
template <class Arrays>
size_t CarveGroupArrays(void* workspace, int64_t groups, Arrays* a) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(workspace);
  const size_t shift = AlignUp(address, 128) - address;
  char* base = static_cast<char*>(workspace) + shift;
  size_t off = 0;
  auto take = [&](auto*& ptr, size_t each, size_t count) {
    off = AlignUp(off, 16);
    ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(base + off);
    off += each * count;
  };
  const size_t g = static_cast<size_t>(groups);
  take(a->rows, sizeof(int64_t), 1);
  take(a->shapes, sizeof(*a->shapes), g);
  take(a->ptr_a, sizeof(void*), g);
  take(a->ptr_b, sizeof(void*), g);
  take(a->ptr_d, sizeof(void*), g);
  take(a->stride_a, sizeof(*a->stride_a), g);
  take(a->stride_b, sizeof(*a->stride_b), g);
  take(a->stride_d, sizeof(*a->stride_d), g);
  take(a->alpha, sizeof(float), g);
  take(a->alpha_ptr, sizeof(float*), g);
  return shift + AlignUp(off, 128);
}

template <class ElementA_, class ElementD_, class ElementB_ = cutlass::float_e4m3_t>
struct GroupedGemm {
  using ProblemShape =
      cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using ElementA = ElementA_;
  using ElementB = ElementB_;
  using ElementD = ElementD_;
  using LayoutA = cutlass::layout::RowMajor;     // lhs rows [m_g, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // rhs[g] [N, K], K contiguous
  using LayoutD = cutlass::layout::RowMajor;     // out rows [m_g, N]
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using TileShape = Shape<_128, _128, _128>;
  using ClusterShape = Shape<_1, _1, _1>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  // Not the FP8FastAccum schedule: the builder then picks the FP8 mainloop that adds the
  // tensor cores' partial sums into a float32 accumulator every mma_promotion_interval (4)
  // K-steps.
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB,
      LayoutB*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Arrays = GroupArrays<Shape3, ElementA, ElementB, ElementD, StrideA, StrideB, StrideD>;

  // Carve's per-group bytes, and its fixed bytes (the row count, each array's alignment
  // padding, the first and final alignments) inside grouped_gemm_limits.h's budget.
  static_assert(sizeof(Shape3) + 3 * sizeof(void*) + sizeof(StrideA) + sizeof(StrideB) +
                        sizeof(StrideD) + sizeof(float) + sizeof(float*) <=
                    kGroupedGemmBytesPerGroup,
                "the per-group arrays outgrow grouped_gemm_limits.h's budget");
  static_assert(128 + sizeof(int64_t) + 10 * 16 + 128 <= kGroupedGemmHeaderBytes,
                "the fixed arrays outgrow grouped_gemm_limits.h's budget");

  using OnDevice = KernelOnDevice<Kernel>;
  static int Prepare(int32_t device) { return OnDevice::Prepare(device); }

  static size_t Carve(void* workspace, int64_t groups, Arrays* a) {
    return CarveGroupArrays(workspace, groups, a);
  }

  static int Run(const GroupedGemmCall& c, int32_t device, cudaStream_t stream) {
    if (int err = Prepare(device)) return err;
    if (c.m == 0 || c.n == 0) return 0;
    Arrays a;
    const size_t arrays = Carve(c.workspace, c.groups, &a);
    if (arrays > c.workspace_bytes) return -1;

    GroupedGemmSetupKernel<<<1, kSetupThreads, 0, stream>>>(c, a);
    if (cudaError_t err = cudaGetLastError()) return err;

    const int64_t row_vectors = c.n * static_cast<int64_t>(sizeof(ElementD)) / 16;
    const int64_t vectors = c.m * row_vectors;
    const int64_t blocks = (vectors + 255) / 256;
    const int zero_blocks = static_cast<int>(
        blocks < 4 * OnDevice::hw[device].sm_count ? blocks : 4 * OnDevice::hw[device].sm_count);
    if (zero_blocks > 0) {
      GroupedGemmZeroKernel<ElementD>
          <<<zero_blocks, 256, 0, stream>>>(static_cast<uint4*>(c.out), a.rows, row_vectors, c.m);
      if (cudaError_t err = cudaGetLastError()) return err;
    }

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

// Defines `extern const GroupedGemmConfig <symbol>` for one instantiation.
#define JAX_FP8_GROUPED_GEMM_CONFIG(symbol, name, lhs_e5m2, out_bf16, ElementA, ElementD) \
  namespace jax_fp8 {                                                                     \
  using symbol##_t = sm90::GroupedGemm<ElementA, ElementD>;                               \
  extern const GroupedGemmConfig symbol;                                                  \
  const GroupedGemmConfig symbol{name, lhs_e5m2, out_bf16, &symbol##_t::Prepare,          \
                                 &symbol##_t::Run};                                       \
  }
