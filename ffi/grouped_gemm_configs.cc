// The table of jax_fp8_grouped_gemm's compiled configurations (grouped_gemm.h). Plain C++:
// the configurations live in their own sm_90a units (grouped_gemm_sm90_*.cu), present only
// when CUTLASS's headers were found.
#include "grouped_gemm.h"

#include "cutlass_config_table.h"

namespace jax_fp8 {

#if defined(JAX_FP8_HAS_CUTLASS)
extern const GroupedGemmConfig kGroupedE4m3Bf16, kGroupedE4m3F32, kGroupedE5m2Bf16, kGroupedE5m2F32;
constexpr const GroupedGemmConfig* kCompiled[] = {&kGroupedE4m3Bf16, &kGroupedE4m3F32,
                                                  &kGroupedE5m2Bf16, &kGroupedE5m2F32};
constexpr CutlassConfigTable<GroupedGemmConfig> kConfigs(kCompiled);
#else
constexpr CutlassConfigTable<GroupedGemmConfig> kConfigs;
#endif

int GroupedGemmConfigCount() { return kConfigs.count(); }
const GroupedGemmConfig& GroupedGemmConfigAt(int i) { return kConfigs.at(i); }

int GroupedGemmFind(bool lhs_e5m2, bool out_bf16) {
  return kConfigs.Find(
      [&](const GroupedGemmConfig& c) { return c.lhs_e5m2 == lhs_e5m2 && c.out_bf16 == out_bf16; });
}

}  // namespace jax_fp8
