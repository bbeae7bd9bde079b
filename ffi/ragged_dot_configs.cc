// The table of jax_fp8_ragged_dot's compiled configurations (ragged_dot.h). Plain C++: the
// configurations live in their own sm_90a units (ragged_dot_sm90_*.cu), present only when
// CUTLASS's headers were found.
#include "ragged_dot.h"

namespace jax_fp8 {

#if defined(JAX_FP8_HAS_CUTLASS)
extern const RaggedDotConfig kRaggedDotForwardBf16, kRaggedDotTransposedBf16, kRaggedDotWgradBf16,
    kRaggedDotWgradBf16F32;
namespace {
const RaggedDotConfig* const kConfigs[] = {&kRaggedDotForwardBf16, &kRaggedDotTransposedBf16,
                                           &kRaggedDotWgradBf16, &kRaggedDotWgradBf16F32};
constexpr int kCount = sizeof(kConfigs) / sizeof(kConfigs[0]);
}  // namespace
#else
namespace {
const RaggedDotConfig* const kConfigs[] = {nullptr};
constexpr int kCount = 0;
}  // namespace
#endif

int RaggedDotConfigCount() { return kCount; }
const RaggedDotConfig& RaggedDotConfigAt(int i) { return *kConfigs[i]; }

int RaggedDotFind(int mode, bool in_f16, bool out_float) {
  for (int i = 0; i < kCount; ++i) {
    const RaggedDotConfig& c = *kConfigs[i];
    if (c.mode == mode && c.in_f16 == in_f16 && c.out_float == out_float) return i;
  }
  return -1;
}

}  // namespace jax_fp8
