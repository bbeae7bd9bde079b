// The table of jax_fp8_ragged_dot's compiled configurations (ragged_dot.h). Plain C++: the
// configurations live in their own sm_90a units (ragged_dot_sm90_*.cu), present only when
// CUTLASS's headers were found.
#include "ragged_dot.h"

#include "cutlass_config_table.h"

namespace jax_fp8 {

#if defined(JAX_FP8_HAS_CUTLASS)
extern const RaggedDotConfig kRaggedDotForwardBf16, kRaggedDotTransposedBf16, kRaggedDotWgradBf16,
    kRaggedDotWgradBf16F32;
constexpr const RaggedDotConfig* kCompiled[] = {&kRaggedDotForwardBf16, &kRaggedDotTransposedBf16,
                                                &kRaggedDotWgradBf16, &kRaggedDotWgradBf16F32};
constexpr CutlassConfigTable<RaggedDotConfig> kConfigs(kCompiled);
#else
constexpr CutlassConfigTable<RaggedDotConfig> kConfigs;
#endif

int RaggedDotConfigCount() { return kConfigs.count(); }
const RaggedDotConfig& RaggedDotConfigAt(int i) { return kConfigs.at(i); }

int RaggedDotFind(int mode, bool in_f16, bool out_float) {
  return kConfigs.Find([&](const RaggedDotConfig& c) {
    return c.mode == mode && c.in_f16 == in_f16 && c.out_float == out_float;
  });
}

}  // namespace jax_fp8
