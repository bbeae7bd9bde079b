// The table of compiled CUTLASS configurations and the measured choice among them and
// cuBLASLt (block_gemm_cutlass.h). Plain C++: the configurations live in their own
// sm_90a units (block_gemm_sm90_*.cu), present only when CUTLASS's headers were found:
// every one with JAX_FP8_CUTLASS_CONFIGS=all (benchmarks), else those the table runs.
#include "block_gemm_cutlass.h"

#include <climits>

#include "cutlass_config_table.h"

namespace jax_fp8 {

#if defined(JAX_FP8_HAS_CUTLASS) && defined(JAX_FP8_CUTLASS_ALL)
extern const CutlassConfig kTileCoop128x128C1Bf16, kTileCoop128x128C2Bf16, kTilePp64x128C1Bf16,
    kTileCoop128x128C1F32, kBlockCoop128x128C1F32, kBlockPp64x128C1F32, kBlockCoop128x128C1Bf16;
constexpr const CutlassConfig* kCompiled[] = {&kTileCoop128x128C1Bf16, &kTileCoop128x128C2Bf16,
                                              &kTilePp64x128C1Bf16,    &kTileCoop128x128C1F32,
                                              &kBlockCoop128x128C1F32, &kBlockPp64x128C1F32,
                                              &kBlockCoop128x128C1Bf16};
constexpr CutlassConfigTable<CutlassConfig> kConfigs(kCompiled);
#elif defined(JAX_FP8_HAS_CUTLASS)  // the configurations the table below runs
extern const CutlassConfig kTileCoop128x128C1Bf16;
constexpr const CutlassConfig* kCompiled[] = {&kTileCoop128x128C1Bf16};
constexpr CutlassConfigTable<CutlassConfig> kConfigs(kCompiled);
#else
constexpr CutlassConfigTable<CutlassConfig> kConfigs;
#endif

int CutlassConfigCount() { return kConfigs.count(); }
const CutlassConfig& CutlassConfigAt(int i) { return kConfigs.at(i); }

bool CutlassTakes(int i, const CutlassGemm& g, bool e4m3_operands, const uint32_t (&align)[5]) {
  if (i < 0 || i >= kConfigs.count() || !e4m3_operands) return false;
  const CutlassConfig& c = kConfigs.at(i);
  const int64_t out_vec = c.out_bf16 ? 8 : 4;  // output elements in 16 bytes (TMA store)
  return !g.a_tile && c.b_tile == g.b_tile && c.out_bf16 == g.out_bf16 && g.m > 0 && g.n > 0 &&
         g.k > 0 && g.batch > 0 && g.m <= INT_MAX && g.n <= INT_MAX && g.k <= INT_MAX &&
         g.batch <= INT_MAX && g.a_scale_size <= INT_MAX && g.b_scale_size <= INT_MAX &&
         g.k % 16 == 0 && g.n % out_vec == 0 && align[0] >= 16 && align[1] >= 16 &&
         align[2] >= 16 && align[3] >= 16 && align[4] >= 4;
}

namespace {

int Find(const char* name) {
  return kConfigs.Find([name](const CutlassConfig& c) {
    const char* a = c.name;
    const char* b = name;
    while (*a && *a == *b) ++a, ++b;
    return *a == *b;
  });
}

}  // namespace

// The measured table (docs/benchmarks.md, "Block-scaled GEMM kernels", bench/
// bench_block_gemm.py): the cooperative 128 x 128 configuration for forward / data-gradient
// GEMMs (b in tiles) with a bf16 output, N <= 4096 and K <= 6144, where it was at least as
// fast as cuBLASLt's block-scaled GEMM; cuBLASLt (-1) for the other shapes and for every
// weight-gradient GEMM, where it was faster.
int CutlassPick(const CutlassGemm& g, bool e4m3_operands, const uint32_t (&align)[5]) {
  if (!g.b_tile || !g.out_bf16 || g.n > 4096 || g.k > 6144) return -1;
  const int i = Find("tile_coop_128x128_c1_bf16");
  return CutlassTakes(i, g, e4m3_operands, align) ? i : -1;
}

}  // namespace jax_fp8
