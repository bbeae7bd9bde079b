// The table of jax_fp8_grouped_wgrad's compiled configurations (grouped_wgrad.h). Plain C++:
// the configurations live in their own sm_90a units (grouped_wgrad_sm90_*.cu), present only
// when CUTLASS's headers were found.
#include "grouped_wgrad.h"

namespace jax_fp8 {

#if defined(JAX_FP8_HAS_CUTLASS)
extern const GroupedWgradConfig kGroupedWgradE4m3E4m3Bf16, kGroupedWgradE4m3E4m3F32,
    kGroupedWgradE4m3E5m2Bf16, kGroupedWgradE4m3E5m2F32;
namespace {
const GroupedWgradConfig* const kConfigs[] = {&kGroupedWgradE4m3E4m3Bf16, &kGroupedWgradE4m3E4m3F32,
                                              &kGroupedWgradE4m3E5m2Bf16,
                                              &kGroupedWgradE4m3E5m2F32};
constexpr int kCount = sizeof(kConfigs) / sizeof(kConfigs[0]);
}  // namespace
#else
namespace {
const GroupedWgradConfig* const kConfigs[] = {nullptr};
constexpr int kCount = 0;
}  // namespace
#endif

int GroupedWgradConfigCount() { return kCount; }
const GroupedWgradConfig& GroupedWgradConfigAt(int i) { return *kConfigs[i]; }

int GroupedWgradFind(bool grad_e5m2, bool out_bf16) {
  for (int i = 0; i < kCount; ++i) {
    if (kConfigs[i]->grad_e5m2 == grad_e5m2 && kConfigs[i]->out_bf16 == out_bf16) return i;
  }
  return -1;
}

}  // namespace jax_fp8
