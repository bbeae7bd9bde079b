// The table of jax_fp8_grouped_wgrad's compiled configurations (grouped_wgrad.h). Plain C++:
// the configurations live in their own sm_90a units (grouped_wgrad_sm90_*.cu), present only
// when CUTLASS's headers were found.
#include "grouped_wgrad.h"

#include "cutlass_config_table.h"

namespace jax_fp8 {

#if defined(JAX_FP8_HAS_CUTLASS)
extern const GroupedWgradConfig kGroupedWgradE4m3E4m3Bf16, kGroupedWgradE4m3E4m3F32,
    kGroupedWgradE4m3E5m2Bf16, kGroupedWgradE4m3E5m2F32;
constexpr const GroupedWgradConfig* kCompiled[] = {
    &kGroupedWgradE4m3E4m3Bf16, &kGroupedWgradE4m3E4m3F32, &kGroupedWgradE4m3E5m2Bf16,
    &kGroupedWgradE4m3E5m2F32};
constexpr CutlassConfigTable<GroupedWgradConfig> kConfigs(kCompiled);
#else
constexpr CutlassConfigTable<GroupedWgradConfig> kConfigs;
#endif

int GroupedWgradConfigCount() { return kConfigs.count(); }
const GroupedWgradConfig& GroupedWgradConfigAt(int i) { return kConfigs.at(i); }

int GroupedWgradFind(bool grad_e5m2, bool out_bf16) {
  return kConfigs.Find([&](const GroupedWgradConfig& c) {
    return c.grad_e5m2 == grad_e5m2 && c.out_bf16 == out_bf16;
  });
}

}  // namespace jax_fp8
