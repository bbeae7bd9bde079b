#pragma once
// The table of a CUTLASS GEMM family's compiled configurations, which each family's
// registry (block_gemm_cutlass.cc, grouped_gemm_configs.cc, grouped_wgrad_configs.cc,
// ragged_dot_configs.cc) fills with the configurations its sm_90a units define, or leaves
// empty where the module was built without CUTLASS's headers. Plain C++.

namespace jax_fp8 {

template <typename Config>
class CutlassConfigTable {
 public:
  // No configuration compiled.
  constexpr CutlassConfigTable() = default;
  // The configurations, in order (their index is what the handlers and the module's
  // *_configs() listings name).
  template <int N>
  constexpr explicit CutlassConfigTable(const Config* const (&configs)[N])
      : configs_(configs), count_(N) {}

  int count() const { return count_; }
  const Config& at(int i) const { return *configs_[i]; }

  // The index of the first configuration `takes` accepts, or -1.
  template <typename Takes>
  int Find(Takes takes) const {
    for (int i = 0; i < count_; ++i) {
      if (takes(*configs_[i])) return i;
    }
    return -1;
  }

 private:
  const Config* const* configs_ = nullptr;
  int count_ = 0;
};

}  // namespace jax_fp8
