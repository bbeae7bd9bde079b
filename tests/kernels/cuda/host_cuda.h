// The CUDA features ffi/block_quantize_cuda.cu uses, on the host
// (tests/kernels/test_block_quantize_host.py compiles the kernel's source with g++ against
// this header): one CTA at a time, its threads as fibers that meet at __syncthreads,
// __syncthreads_or and the warp reductions (host_cuda.cc), shared memory filled with
// garbage before each CTA. The instructions follow
// the PTX ISA: cvt.rn.satfinite.{e4m3,e5m2}x2.f32 rounds to nearest even with subnormal
// inputs and saturates beyond the largest finite value (inf included); a NaN input gives
// the canonical NaN 0x7F whatever its sign (host_nan_keeps_sign = 1 keeps the sign
// instead, to show that the kernel's bytes do not depend on it). cvt.f32.f16 is exact
// (NaN -> canonical NaN).
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint2 { uint32_t x, y; };
struct uint4 { uint32_t x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "host emulation"; }

extern thread_local uint3 threadIdx, blockIdx;
extern thread_local dim3 gridDim, blockDim;

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline uint32_t max(uint32_t a, uint32_t b) { return a > b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline uint32_t __vmaxu2(uint32_t a, uint32_t b) {
  uint32_t lo = std::max(a & 0xFFFFu, b & 0xFFFFu), hi = std::max(a >> 16, b >> 16);
  return lo | (hi << 16);
}
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t in = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= uint32_t((in >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return r;
}

// ---- half / bfloat16
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline float __half2float(__half h) {  // cvt.f32.f16: exact; NaN -> canonical NaN
  const uint32_t u = h.x, sign = (u & 0x8000u) << 16, e = (u >> 10) & 0x1F, m = u & 0x3FF;
  if (e == 31) return __uint_as_float(m ? 0x7FFFFFFFu : (sign | 0x7F800000u));
  if (e == 0) {
    float f = std::ldexp(float(m), -24);
    return __uint_as_float(__float_as_uint(f) | sign);
  }
  return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}

// ---- fp8: cvt.rn.satfinite.{e4m3,e5m2}x2.f32 (PTX): NaN -> 0x7F, |x| > max -> +-max,
// else round to nearest even (subnormal inputs included, no flush).
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
extern int host_nan_keeps_sign;  // 0: NaN -> 0x7F; 1: NaN -> 0x7F | sign
inline double host_fp8_value(int code, bool e5m2) {
  const int mb = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const int e = code >> mb, m = code & ((1 << mb) - 1);
  if (e == 0) return std::ldexp(double(m), 1 - bias - mb);
  return std::ldexp(double((1 << mb) | m), e - bias - mb);
}
inline uint8_t host_cvt1(float x, bool e5m2) {
  const uint32_t u = __float_as_uint(x), sign = (u >> 24) & 0x80u;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return host_nan_keeps_sign ? (0x7F | sign) : 0x7F;
  const int maxcode = e5m2 ? 0x7B : 0x7E;
  const double a = std::fabs(double(x));
  if (a >= host_fp8_value(maxcode, e5m2)) return sign | maxcode;
  int lo = 0;
  while (lo < maxcode && host_fp8_value(lo + 1, e5m2) <= a) ++lo;
  const double vlo = host_fp8_value(lo, e5m2), vhi = host_fp8_value(lo + 1, e5m2);
  int c;
  if (a - vlo < vhi - a) c = lo;
  else if (a - vlo > vhi - a) c = lo + 1;
  else c = (lo % 2 == 0) ? lo : lo + 1;
  return sign | c;
}
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 v, __nv_saturation_t,
                                                      __nv_fp8_interpretation_t t) {
  const bool e5 = t == __NV_E5M2;
  return (__nv_fp8x2_storage_t)(host_cvt1(v.x, e5) | (host_cvt1(v.y, e5) << 8));
}

// ---- CTAs: one at a time, a fiber per CUDA thread (host_cuda.cc)
void host_syncthreads();
int host_syncthreads_or(int pred);
uint32_t host_reduce_max(uint32_t v);
void* host_shared(size_t n);
inline void __syncthreads() { host_syncthreads(); }
inline int __syncthreads_or(int p) { return host_syncthreads_or(p); }
inline uint32_t __reduce_max_sync(unsigned, uint32_t v) { return host_reduce_max(v); }

void host_run_grid(dim3 grid, unsigned threads, void (*body)(void*), void* ctx);

template <typename A, typename P>
struct HostCall { void (*k)(A, P); const A* a; const P* p; };
template <typename A, typename P>
void HostLaunch(void (*k)(A, P), dim3 grid, unsigned threads, const A& a, const P& p) {
  HostCall<A, P> c{k, &a, &p};
  host_run_grid(grid, threads, [](void* v) {
    auto* c = static_cast<HostCall<A, P>*>(v);
    c->k(*c->a, *c->p);
  }, &c);
}
