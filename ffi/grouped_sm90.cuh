#pragma once
// What the three grouped GEMM families share (grouped_gemm_sm90.cuh, grouped_wgrad_sm90.cuh,
// ragged_dot_sm90.cuh): CUTLASS's SM90 ptr-array grouped GEMM (TMA loads with per-group
// descriptors rewritten on the device, warp-specialized cooperative wgmma mainloop
// accumulating in float32, persistent group tile scheduler, TMA epilogue
// out = alpha_g * accumulator, no source tensor) of one operand / output type and layout; the
// per-group arrays a setup kernel writes on the device (no host synchronization, so the
// custom call can be captured in a CUDA graph) and their place in the workspace; the block-
// wide scan that turns group sizes into each group's rows; the zeroing of the output rows
// past the groups.

#include <type_traits>

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
#include "grouped_gemm_workspace.h"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "the grouped GEMMs need CUDA >= 12.3 (modifiable TMA descriptors on SM90)"
#endif

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

using namespace cute;

constexpr int kSetupThreads = 256;

// The device-side arrays of one call, carved out of the workspace (CarveGroupArrays).
template <class Shape3_, class EA, class EB, class ED, class SA, class SB, class SD>
struct GroupArrays {
  using Shape3 = Shape3_;
  using ElementA = EA;
  using ElementB = EB;
  using ElementD = ED;
  using StrideA = SA;
  using StrideB = SB;
  using StrideD = SD;
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

// A CUTLASS ptr-array stride (one int64_t mode, the others static) with that mode `ld`.
template <class Stride>
__device__ Stride PackedStride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// Each group's rows [start, end) of `cap` rows: the sizes clamped to [0, cap] and their
// saturating (at cap) prefix sums, computed by one block of kSetupThreads threads
// (Hillis-Steele scans of kSetupThreads sizes at a time, the carry between chunks saturating
// too: min(a + b, cap) is associative on [0, cap]). Every thread of the block calls
// visit(g, start, end) once per chunk, g = chunk start + threadIdx.x (g >= groups: an empty
// range; visit may itself synchronize the block); *rows = the rows all groups cover.
template <class Visit>
__device__ void ForEachGroupRows(const int32_t* sizes, int64_t groups, int64_t cap, int64_t* rows,
                                 Visit&& visit) {
  __shared__ int64_t scan[kSetupThreads];
  __shared__ int64_t carry;
  const int t = threadIdx.x;
  if (t == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < groups; base += kSetupThreads) {
    const int64_t g = base + t;
    int64_t v = 0;
    if (g < groups) {
      const int64_t raw = sizes[g];
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
    visit(g, start, end);
    __syncthreads();
    if (t == kSetupThreads - 1) carry = end;
    __syncthreads();
  }
  if (t == 0) *rows = carry;
}

// Zeroes out[rows:m, :] (rows read from the setup kernel's result), 16 bytes a store: rows
// are multiples of 16 bytes (the families' limits headers) and the buffer 16-byte aligned.
// A template (on the output type) so that each configuration's unit may define it.
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

// Enqueues GroupedGemmZeroKernel over out [m, n] (at most 4 blocks per SM, grid-strided).
template <class ElementD>
int ZeroRowsPastGroups(void* out, const int64_t* rows, int64_t m, int64_t n, int sm_count,
                       cudaStream_t stream) {
  const int64_t row_vectors = n * static_cast<int64_t>(sizeof(ElementD)) / 16;
  const int64_t blocks = (m * row_vectors + 255) / 256;
  const int zero_blocks = static_cast<int>(blocks < 4 * sm_count ? blocks : 4 * sm_count);
  if (zero_blocks == 0) return 0;
  GroupedGemmZeroKernel<ElementD>
      <<<zero_blocks, 256, 0, stream>>>(static_cast<uint4*>(out), rows, row_vectors, m);
  return static_cast<int>(cudaGetLastError());
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

// CUTLASS's SM90 ptr-array grouped GEMM of A (ElementA, LayoutA) times B (ElementB,
// LayoutB) into D (ElementD, row-major), tiles TileShape, one CTA per cluster. On FP8
// operands the builder picks the FP8 mainloop that adds the tensor cores' partial sums into
// a float32 accumulator every mma_promotion_interval (4) K-steps (the schedule is not
// FP8FastAccum); on 16-bit operands it accumulates in float32 throughout.
template <class ElementA_, class LayoutA, class ElementB_, class LayoutB, class ElementD_,
          class TileShape>
struct PtrArrayGemm {
  using ProblemShape =
      cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using ElementA = ElementA_;
  using ElementB = ElementB_;
  using ElementD = ElementD_;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignA = 16 / sizeof(ElementA);
  static constexpr int kAlignB = 16 / sizeof(ElementB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using ClusterShape = Shape<_1, _1, _1>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA, ElementB,
      LayoutB*, kAlignB, float, TileShape, ClusterShape,
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
  using OnDevice = KernelOnDevice<Kernel>;

  // Carve's per-group bytes, and its fixed bytes (the row count, each array's alignment
  // padding, the first and final alignments) inside grouped_gemm_workspace.h's budget.
  static_assert(sizeof(Shape3) + 3 * sizeof(void*) + sizeof(StrideA) + sizeof(StrideB) +
                        sizeof(StrideD) + sizeof(float) + sizeof(float*) <=
                    kGroupedGemmBytesPerGroup,
                "the per-group arrays outgrow grouped_gemm_workspace.h's budget");
  static_assert(128 + sizeof(int64_t) + 10 * 16 + 128 <= kGroupedGemmHeaderBytes,
                "the fixed arrays outgrow grouped_gemm_workspace.h's budget");

  static int Prepare(int32_t device) { return OnDevice::Prepare(device); }

  // Carves `c`'s workspace (c.workspace, c.workspace_bytes, c.groups) into the per-group
  // arrays, runs `prologue(a)` (the setup kernel that fills them, and any zeroing; 0 or a
  // cudaError_t), then the grouped GEMM over them on `stream`: its epilogue multiplies by
  // alpha_g read through the arrays' alpha pointers (`alpha_per_group`) or by 1. 0, a
  // cudaError_t, or -1 when CUTLASS cannot implement it / the workspace is short.
  template <class Call, class Prologue>
  static int Run(const Call& c, bool alpha_per_group, int32_t device, cudaStream_t stream,
                 Prologue&& prologue) {
    Arrays a;
    const size_t arrays = CarveGroupArrays(c.workspace, c.groups, &a);
    if (arrays > c.workspace_bytes) return -1;
    if (int err = prologue(a)) return err;

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(c.groups), a.shapes, nullptr};  // on the device only
    args.mainloop = {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = alpha_per_group ? 0.0f : 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = alpha_per_group ? a.alpha_ptr : nullptr;
    fusion.beta_ptr_array = nullptr;
    if (alpha_per_group) {
      fusion.dAlpha = {_0{}, _0{}, 1};
      fusion.dBeta = {_0{}, _0{}, 0};
    }
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

// The FP8 grouped GEMM of jax_fp8_grouped_gemm and jax_fp8_grouped_wgrad: both operands
// K-major (A rows [M, K], B [N, K]), 128 x 128 x 128 tiles.
template <class ElementA, class ElementB, class ElementD>
using Fp8PtrArrayGemm =
    PtrArrayGemm<ElementA, cutlass::layout::RowMajor, ElementB, cutlass::layout::ColumnMajor,
                 ElementD, Shape<_128, _128, _128>>;

}  // namespace
}  // namespace sm90
}  // namespace jax_fp8
