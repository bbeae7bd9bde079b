// The table of jax_fp8_grouped_gemm's compiled configurations (grouped_gemm.h). Plain C++:
// the configurations live in their own sm_90a units (grouped_gemm_sm90_*.cu), present only
// when CUTLASS's headers were found.
#include "grouped_gemm.h"

namespace jax_fp8 {

#if defined(JAX_FP8_HAS_CUTLASS)
extern const GroupedGemmConfig kGroupedE4m3Bf16, kGroupedE4m3F32, kGroupedE5m2Bf16, kGroupedE5m2F32;
namespace {
const GroupedGemmConfig* const kConfigs[] = {&kGroupedE4m3Bf16, &kGroupedE4m3F32, &kGroupedE5m2Bf16,
                                             &kGroupedE5m2F32};
constexpr int kCount = sizeof(kConfigs) / sizeof(kConfigs[0]);
}  // namespace
#else
namespace {
const GroupedGemmConfig* const kConfigs[] = {nullptr};
constexpr int kCount = 0;
}  // namespace
#endif

int GroupedGemmConfigCount() { return kCount; }
const GroupedGemmConfig& GroupedGemmConfigAt(int i) { return *kConfigs[i]; }

int GroupedGemmFind(bool lhs_e5m2, bool out_bf16) {
  for (int i = 0; i < kCount; ++i) {
    if (kConfigs[i]->lhs_e5m2 == lhs_e5m2 && kConfigs[i]->out_bf16 == out_bf16) return i;
  }
  return -1;
}

}  // namespace jax_fp8
