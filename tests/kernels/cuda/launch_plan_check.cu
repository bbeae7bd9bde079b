// Host-side check of the CUDA launcher's planning (no GPU needed): which offset width a
// call gets and how its groups are split into launches. Built and run by
// tests/kernels/test_launch_plan.py with nvcc; prints "OK" or the first failed check.
#include "../../../ffi/update_cuda.cu"

#include <cstdio>
#include <vector>

using namespace jax_fp8;

namespace {

int failures = 0;

void Check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

// n per-tensor groups of history `len`; states packed from `states`, amaxes at `amaxes`.
std::vector<TensorGroup> Groups(int n, int64_t len, uintptr_t states, uintptr_t amaxes) {
  std::vector<TensorGroup> g(n);
  const uintptr_t scales = states + uintptr_t(n) * len * 4;
  for (int i = 0; i < n; ++i) {
    g[i] = TensorGroup{reinterpret_cast<float*>(states + uintptr_t(i) * len * 4),
                       reinterpret_cast<float*>(scales + i * 4),
                       reinterpret_cast<float*>(scales + uintptr_t(n) * 4 + i * 4),
                       reinterpret_cast<const float*>(amaxes + i * 4), 1, len, 448.0f};
  }
  return g;
}

template <int K, typename Off>
size_t Chunks(const std::vector<TensorGroup>& g, bool* offsets_exact) {
  static LaunchParams<K, Off> p;
  size_t first = 0, chunks = 0;
  *offsets_exact = true;
  while (first < g.size()) {
    int64_t max_len = 1;
    const size_t next = FillParams<K>(g.data(), first, g.size(), UpdateOptions{}, &p, &max_len);
    for (size_t j = first, k = 0; j < next; ++j, ++k) {
      *offsets_exact &= p.base + p.history[k] == g[j].history &&
                        p.base + p.scale[k] == g[j].scale &&
                        p.base + p.scale_inv[k] == g[j].scale_inv &&
                        p.base + p.amax[k] == g[j].amax &&
                        p.base + p.history_out[k] == g[j].HistoryOut() &&
                        p.base + p.scale_out[k] == g[j].ScaleOut();
    }
    first = next;
    ++chunks;
  }
  return chunks;
}

}  // namespace

int main() {
  const uintptr_t base = 0x7f0000000000ull;
  bool exact = false;
  // A train step's 288 states with their amaxes 20 GB away (XLA's temporary buffer):
  // 64-bit offsets, ONE launch (not one launch per state).
  auto far = Groups(288, 1024, base, base + (20ull << 30));
  Check(NeedsWideOffsets(far.data(), far.size()), "amaxes 20 GB away need 64-bit offsets");
  Check(Chunks<kMaxGroupsPerWideLaunch, uint64_t>(far, &exact) == 1, "288 far groups: 1 launch");
  Check(exact, "64-bit offsets address every buffer exactly");
  // 2,000 such states: 580 per launch.
  auto many = Groups(2000, 16, base, base + (40ull << 30));
  Check(Chunks<kMaxGroupsPerWideLaunch, uint64_t>(many, &exact) == 4, "2,000 far groups: 4 launches");
  Check(exact, "64-bit offsets exact over 4 launches");
  // Out of place: results in buffers of their own; their offsets are exact too, and
  // results 20 GB from the operands need 64-bit offsets.
  auto out_of_place = Groups(300, 16, base, base + (1ull << 30));
  for (size_t i = 0; i < out_of_place.size(); ++i) {
    out_of_place[i].history_out = reinterpret_cast<float*>(base + (20ull << 30) + i * 64);
    out_of_place[i].scale_out = reinterpret_cast<float*>(base + (21ull << 30) + i * 4);
  }
  Check(NeedsWideOffsets(out_of_place.data(), out_of_place.size()), "far results: 64-bit offsets");
  Check(Chunks<kMaxGroupsPerWideLaunch, uint64_t>(out_of_place, &exact) == 1, "300 out of place: 1 launch");
  Check(exact, "64-bit offsets address every result exactly");
  // Everything within 16 GB: 32-bit offsets, 1,020 groups per launch.
  auto near = Groups(1500, 1024, base, base + (1ull << 30));
  Check(!NeedsWideOffsets(near.data(), near.size()), "buffers within 16 GB keep 32-bit offsets");
  Check(Chunks<kMaxGroupsPerLaunch, uint32_t>(near, &exact) == 2, "1,500 near groups: 2 launches");
  Check(exact, "32-bit offsets address every buffer exactly");
  // Empty groups are skipped and decide nothing.
  std::vector<TensorGroup> none(3, TensorGroup{nullptr, nullptr, nullptr, nullptr, 0, 4, 448.0f});
  Check(!NeedsWideOffsets(none.data(), none.size()), "empty groups: no span");
  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
