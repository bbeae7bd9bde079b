#pragma once
// One CUTLASS SM90 block-scaled FP8 GEMM configuration (block_gemm_cutlass.h): TMA loads,
// warp-specialized wgmma mainloop with the per-K-block promotion of CUTLASS's blockwise
// collective, persistent tile scheduler, and a plain epilogue (out = accumulator, rounded
// once to the output type; no source tensor). Included by one .cu file per configuration.
//
// Scale layouts (block_scale_layout.h) map onto CUTLASS's blockwise scale layouts with
// their padded strides: a's 1 x 128 blocks [Kb, ld] are "M-major" with stride ld along K
// blocks; b's 128 x 128 tiles [Nb, ld] are "K-major" with stride ld along N tiles, b's
// 1 x 128 blocks [Kb, ld] "N-major" like a's.

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "block_gemm_cutlass.h"
#include "cutlass_launch.cuh"

namespace jax_fp8 {
namespace sm90 {
// This unit's own (cutlass_launch.cuh says why).
namespace {

using namespace cute;

template <int kGranN, class ElementD, class TileShape, class ClusterShape, bool kPingpong>
struct BlockScaledGemm {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using LayoutA = cutlass::layout::RowMajor;     // a [M, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // b [N, K], K contiguous
  using LayoutD = cutlass::layout::RowMajor;     // out [M, N]
  static constexpr int kAlignAB = 16;
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  // a: 1 x 128 blocks, M-major; b: 128 x 128 tiles K-major, or 1 x 128 blocks N-major.
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, kGranN, 128, cute::GMMA::Major::MN,
                                                kGranN == 1 ? cute::GMMA::Major::MN
                                                            : cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using MainloopSchedule =
      std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignD,
      ElementD, LayoutD, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA, LayoutSFA>, kAlignAB, ElementB, cute::tuple<LayoutB, LayoutSFB>,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                           CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;

  using OnDevice = KernelOnDevice<Kernel>;
  static int Prepare(int32_t device) { return OnDevice::Prepare(device); }

  static typename Gemm::Arguments Arguments(const CutlassGemm& g, int32_t device) {
    const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
    const int l = static_cast<int>(g.batch);
    const int kb = static_cast<int>((g.k + 127) / 128);
    StrideA sa = make_stride(g.k, Int<1>{}, g.m * g.k);
    StrideB sb = make_stride(g.k, Int<1>{}, g.n * g.k);
    StrideD sd = make_stride(g.n, Int<1>{}, g.m * g.n);
    // a: [Kb, ld] per GEMM (rows contiguous)
    LayoutSFA lsa =
        make_layout(make_shape(make_shape(Int<1>{}, m), make_shape(Int<128>{}, kb), l),
                    make_stride(make_stride(Int<0>{}, Int<1>{}),
                                make_stride(Int<0>{}, static_cast<int32_t>(g.a_scale_ld)),
                                static_cast<int32_t>(g.a_scale_size)));
    LayoutSFB lsb;
    if constexpr (kGranN == 1) {  // b: [Kb, ld], rows contiguous
      lsb = make_layout(make_shape(make_shape(Int<1>{}, n), make_shape(Int<128>{}, kb), l),
                        make_stride(make_stride(Int<0>{}, Int<1>{}),
                                    make_stride(Int<0>{}, static_cast<int32_t>(g.b_scale_ld)),
                                    static_cast<int32_t>(g.b_scale_size)));
    } else {  // b: [Nb, ld], K blocks contiguous
      lsb = make_layout(
          make_shape(make_shape(Int<128>{}, (n + 127) / 128), make_shape(Int<128>{}, kb), l),
          make_stride(make_stride(Int<0>{}, static_cast<int32_t>(g.b_scale_ld)),
                      make_stride(Int<0>{}, Int<1>{}), static_cast<int32_t>(g.b_scale_size)));
    }
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, l},
        {static_cast<const ElementA*>(g.a), sa, static_cast<const ElementB*>(g.b), sb, g.a_scale,
         lsa, g.b_scale, lsb},
        {{}, nullptr, sd, static_cast<ElementD*>(g.out), sd},
        OnDevice::hw[device]};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }

  static int Run(const CutlassGemm& g, int32_t device, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream) {
    if (int err = Prepare(device)) return err;
    typename Gemm::Arguments args = Arguments(g, device);
    if (Gemm::get_workspace_size(args) > workspace_bytes) return -1;
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return -1;
    const typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
    return OnDevice::Launch(params, stream);
  }
};

}  // namespace
}  // namespace sm90
}  // namespace jax_fp8

// Defines `extern const CutlassConfig <symbol>` for one instantiation.
#define JAX_FP8_CUTLASS_CONFIG(symbol, name, b_tile, out_bf16, ...)                   \
  namespace jax_fp8 {                                                                 \
  using symbol##_t = sm90::BlockScaledGemm<__VA_ARGS__>;                              \
  extern const CutlassConfig symbol;                                                  \
  const CutlassConfig symbol{name,                                                    \
                             b_tile,                                                  \
                             out_bf16,                                                \
                             cute::size<0>(typename symbol##_t::Kernel::TileShape{}), \
                             &symbol##_t::Prepare,                                    \
                             &symbol##_t::Run};                                       \
  }
