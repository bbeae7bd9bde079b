// CPU kernel and XLA FFI handler of the fused update: a serial loop over every
// tensor of every group, calling the shared arithmetic of scaling_math.h.
#include "update_cpu.h"

#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "scaling_math.h"
#include "update_decode.h"

namespace jax_fp8 {
namespace {

// XLA's CPU threads may run with flush-to-zero / denormals-are-zero set; docs/semantics.md
// requires IEEE subnormals, so clear those modes for the duration of the update.
class ScopedIeeeSubnormals {
 public:
  ScopedIeeeSubnormals() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u));  // FTZ (bit 15), DAZ (bit 6)
#elif defined(__aarch64__)
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    uint64_t cleared = saved_ & ~(uint64_t{1} << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(cleared));
#endif
  }
  ~ScopedIeeeSubnormals() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedIeeeSubnormals(const ScopedIeeeSubnormals&) = delete;
  ScopedIeeeSubnormals& operator=(const ScopedIeeeSubnormals&) = delete;

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned int saved_ = 0;
#endif
};

// Max over h[1..len), from +0, with kLanes independent accumulators so the loop
// vectorises (running_max is associative up to the sign of zero, see scaling_math.h).
float HistoryMax(const float* h, int64_t len) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t j = 1;
  for (; j + kLanes <= len; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] = running_max(acc[k], h[j + k]);
  }
  for (; j < len; ++j) acc[0] = running_max(acc[0], h[j]);
  float rest = 0.0f;
  for (int k = 0; k < kLanes; ++k) rest = running_max(rest, acc[k]);
  return rest;
}

// h and h_out (and scale and scale_out) are the same buffer in place, else disjoint.
void UpdateTensor(const float* h, float* h_out, const float* scale, float* scale_out,
                  float* scale_inv, const float* amax, int64_t len, float scaled_max,
                  const UpdateOptions& opt) {
  const float h0 = merge_amax(h[0], amax);
  const float prev = *scale;
  if (is_unused(h0, opt)) {
    if (h_out != h) std::memcpy(h_out, h, static_cast<size_t>(len) * sizeof(float));
    *scale_out = prev;
    *scale_inv = scale_inverse(prev);
    return;
  }
  const float rest = HistoryMax(h, len);
  // Roll: old[j] -> j - 1 for j >= 2, slot 0 cleared, h0 last (memmove: in place too).
  if (len > 2) std::memmove(h_out + 1, h + 2, static_cast<size_t>(len - 2) * sizeof(float));
  h_out[0] = 0.0f;
  h_out[len - 1] = last_slot_value(h0, len);
  const float s = new_scale(reduced_amax(h0, rest, opt), prev, scaled_max, opt);
  *scale_out = s;
  *scale_inv = scale_inverse(s);
}

ffi::Error UpdateCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                         ffi::Span<const float> scaled_max, int32_t algo, bool power_of_2_scale,
                         bool skip_unused, bool has_scale_inv, bool has_amax, bool in_place) {
  auto opt = DecodeOptions(algo, power_of_2_scale, skip_unused);
  if (!opt.has_value()) return opt.error();
  auto groups = DecodeGroups(args, rets, scaled_max, has_scale_inv, has_amax, in_place);
  if (!groups.has_value()) return groups.error();
  ScopedIeeeSubnormals ieee;
  for (const TensorGroup& g : *groups) {
    float* h_out = g.HistoryOut();
    float* s_out = g.ScaleOut();
    for (int64_t t = 0; t < g.count; ++t) {
      UpdateTensor(g.history + t * g.len, h_out + t * g.len, g.scale + t, s_out + t,
                   g.scale_inv + t, g.amax ? g.amax + t : nullptr, g.len, g.scaled_max, *opt);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFp8UpdateCpu, UpdateCpuImpl,
    JAX_FP8_UPDATE_ATTRS(ffi::Ffi::Bind().RemainingArgs().RemainingRets()));

}  // namespace jax_fp8
