// The per-tensor arithmetic of the delayed-scaling update (docs/semantics.md), in one place.
//
// Every function here is __host__ __device__ and inline, so the CPU loop
// (update_cpu.cc) and the CUDA kernel (update_cuda.cu) compile the very same
// expressions. Comparisons and classifications work on the float's bits where a
// library call could differ between host and device (signed zeros, NaN), so the
// two paths agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JAX_FP8_HD __host__ __device__ __forceinline__
#else
#define JAX_FP8_HD inline
#endif

// Flushing subnormals would change results that docs/semantics.md pins down (1 / FLT_MAX is a
// subnormal); refuse to build the device code that way.
#if defined(__CUDA_ARCH__) && defined(__CUDACC_FTZ__)
#error "jax_fp8 kernels must be built without -ftz=true / --use_fast_math"
#endif

namespace jax_fp8 {

// Largest finite float32 (FLT_MAX), spelled as bits to avoid <cfloat> on device.
constexpr uint32_t kFltMaxBits = 0x7F7FFFFFu;
constexpr uint32_t kPow2Mask = 0xFF800000u;  // sign + exponent: round down to 2^k

enum class AmaxAlgo : int32_t { kMax = 0, kMostRecent = 1 };

// Options shared by every tensor of one call (the recipe's part of docs/semantics.md).
struct UpdateOptions {
  AmaxAlgo algo;
  bool power_of_2_scale;
  bool skip_unused;
};

JAX_FP8_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

JAX_FP8_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

JAX_FP8_HD bool is_nan(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
JAX_FP8_HD bool is_inf(float x) { return (float_bits(x) & 0x7FFFFFFFu) == 0x7F800000u; }
JAX_FP8_HD bool is_finite(float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; }

// fmaxf with every case fixed (IEEE 754-2019 maximumNumber): a NaN operand is
// ignored (NaN only if both are NaN) and +0 is larger than -0. It is commutative
// and associative, so a parallel reduction gives the bits of a serial one.
JAX_FP8_HD float fmax_num(float a, float b) {
  if (is_nan(a)) return b;
  if (is_nan(b)) return a;
  if (a == b) return (float_bits(a) & 0x80000000u) ? b : a;
  return a > b ? a : b;
}

// One step of the max over the history, which starts from +0: `x > acc` is false
// for a NaN x, so NaN is ignored exactly as fmax_num ignores it. It can differ from
// fmax_num only in the sign of a zero result, and the reduced amax is only ever
// tested with `> 0` and divided by when positive, so the scale bits are the same.
// It is a plain compare-select, which the CPU compiler turns into SIMD max (maxps);
// the CUDA kernel keeps fmax_num.
JAX_FP8_HD float running_max(float acc, float x) { return x > acc ? x : acc; }

// The staging slot after merging the newly observed amax (h0 in docs/semantics.md).
JAX_FP8_HD float merge_amax(float staged, const float* amax) {
  return amax ? fmax_num(staged, *amax) : staged;
}

// skip_unused: a tensor whose staged amax is zero was not used this step.
JAX_FP8_HD bool is_unused(float h0, const UpdateOptions& opt) {
  return opt.skip_unused && h0 == 0.0f;
}

// The amax the scale is computed from, given h0 and the max over h[1..L-1]
// (itself started from 0 with fmax_num).
JAX_FP8_HD float reduced_amax(float h0, float max_of_rest, const UpdateOptions& opt) {
  return opt.algo == AmaxAlgo::kMostRecent ? h0 : fmax_num(max_of_rest, h0);
}

// New quantization scale from the reduced amax and the previous scale.
JAX_FP8_HD float new_scale(float amax, float prev_scale, float scaled_max,
                           const UpdateOptions& opt) {
  float s = (is_finite(amax) && amax > 0.0f) ? scaled_max / amax : prev_scale;
  if (is_inf(s)) s = bits_float(kFltMaxBits);
  if (opt.power_of_2_scale) s = bits_float(float_bits(s) & kPow2Mask);
  return s;
}

// 1 / scale. A NaN scale gives that NaN, quieted (what x86 and numpy do); CUDA's
// division would return its canonical NaN instead, so both paths spell it out.
JAX_FP8_HD float scale_inverse(float scale) {
  return is_nan(scale) ? bits_float(float_bits(scale) | 0x00400000u) : 1.0f / scale;
}

// The rolled history, written as where each old element goes: the staging slot
// becomes 0, old[j] moves to j - 1 for 2 <= j < L (old[1], the oldest, drops out),
// and h0 lands at L - 1. For L == 1 the history is just [0].
JAX_FP8_HD float last_slot_value(float h0, int64_t len) { return len == 1 ? 0.0f : h0; }

}  // namespace jax_fp8
