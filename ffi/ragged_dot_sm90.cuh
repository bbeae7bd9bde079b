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
#include "grouped_gemm_sm90.cuh"
#include "ragged_dot.h"

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

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

template <int kMode, class Shape3, class EA, class EB, class ED, class SA, class SB, class SD>
__global__ void __launch_bounds__(kSetupThreads)
    RaggedDotSetupKernel(RaggedDotCall c, GroupArrays<Shape3, EA, EB, ED, SA, SB, SD> a) {
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
    const int size = static_cast<int>(end - start);
    if (g < c.groups) {
      const int k = static_cast<int>(c.k), n = static_cast<int>(c.n);
      if constexpr (kMode == kRaggedWeightGrad) {
        a.shapes[g] = Shape3{size > 0 ? k : 0, n, size};
        a.ptr_a[g] = static_cast<const EA*>(c.lhs) + start * c.k;
        a.ptr_b[g] = static_cast<const EB*>(c.rhs) + start * c.n;
        a.ptr_d[g] = static_cast<ED*>(c.out) + g * c.k * c.n;
        a.stride_a[g] = PackedStride<SA>(c.k);
        a.stride_b[g] = PackedStride<SB>(c.n);
      } else {
        a.shapes[g] = Shape3{size, n, k};
        a.ptr_a[g] = static_cast<const EA*>(c.lhs) + start * c.k;
        a.ptr_b[g] = static_cast<const EB*>(c.rhs) + g * c.n * c.k;
        a.ptr_d[g] = static_cast<ED*>(c.out) + start * c.n;
        a.stride_a[g] = PackedStride<SA>(c.k);
        a.stride_b[g] = PackedStride<SB>(kMode == kRaggedForward ? c.n : c.k);
      }
      a.stride_d[g] = PackedStride<SD>(c.n);
    }
    __syncthreads();
    if (t == kSetupThreads - 1) carry = end;
    __syncthreads();
  }
  if (t == 0) *a.rows = carry;
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
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K)
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using LayoutA = std::conditional_t<kMode == kRaggedWeightGrad, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<kMode == kRaggedTransposed, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(Element);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using TileShape = Shape<_128, _128, _64>;
  using ClusterShape = Shape<_1, _1, _1>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignAB, Element,
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
  using Arrays = GroupArrays<Shape3, Element, Element, ElementD, StrideA, StrideB, StrideD>;
  using OnDevice = KernelOnDevice<Kernel>;

  static_assert(sizeof(Shape3) + 3 * sizeof(void*) + sizeof(StrideA) + sizeof(StrideB) +
                        sizeof(StrideD) + sizeof(float) + sizeof(float*) <=
                    kGroupedGemmBytesPerGroup,
                "the per-group arrays outgrow grouped_gemm_limits.h's budget");

  static int Prepare(int32_t device) { return OnDevice::Prepare(device); }

  static int Run(const RaggedDotCall& c, int32_t device, cudaStream_t stream) {
    if (int err = OnDevice::Prepare(device)) return err;
    const bool wgrad = kMode == kRaggedWeightGrad;
    if (c.k == 0 || c.n == 0 || (!wgrad && c.m == 0)) return 0;
    Arrays a;
    const size_t arrays = CarveGroupArrays(c.workspace, c.groups, &a);
    if (arrays > c.workspace_bytes) return -1;

    RaggedDotSetupKernel<kMode><<<1, kSetupThreads, 0, stream>>>(c, a);
    if (cudaError_t err = cudaGetLastError()) return err;

    if constexpr (kMode == kRaggedWeightGrad) {
      const int64_t group_vectors = c.k * c.n * static_cast<int64_t>(sizeof(ElementD)) / 16;
      const int64_t per_group = (group_vectors + 255) / 256;
      const dim3 grid(static_cast<unsigned>(per_group < 8 ? per_group : 8),
                      static_cast<unsigned>(c.groups < 65535 ? c.groups : 65535));
      RaggedDotZeroEmptyKernel<<<grid, 256, 0, stream>>>(static_cast<uint4*>(c.out), a.shapes,
                                                         c.groups, group_vectors);
      if (cudaError_t err = cudaGetLastError()) return err;
    } else {
      const int64_t row_vectors = c.n * static_cast<int64_t>(sizeof(ElementD)) / 16;
      const int64_t blocks = (c.m * row_vectors + 255) / 256;
      const int sms = OnDevice::hw[device].sm_count;
      const int zero_blocks = static_cast<int>(blocks < 4 * sms ? blocks : 4 * sms);
      if (zero_blocks > 0) {
        GroupedGemmZeroKernel<ElementD>
            <<<zero_blocks, 256, 0, stream>>>(static_cast<uint4*>(c.out), a.rows, row_vectors, c.m);
        if (cudaError_t err = cudaGetLastError()) return err;
      }
    }

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {static_cast<int>(c.groups), a.shapes, nullptr};  // on the device only
    args.mainloop = {a.ptr_a, a.stride_a, a.ptr_b, a.stride_b};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
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

// Defines `extern const RaggedDotConfig <symbol>` for one instantiation.
#define JAX_FP8_RAGGED_DOT_CONFIG(symbol, name, mode, in_f16, out_float, Element, ElementD) \
  namespace jax_fp8 {                                                                       \
  using symbol##_t = sm90::RaggedDot<mode, Element, ElementD>;                              \
  extern const RaggedDotConfig symbol;                                                      \
  const RaggedDotConfig symbol{                                                             \
      name, mode, in_f16, out_float, &symbol##_t::Prepare, &symbol##_t::Run};               \
  }
