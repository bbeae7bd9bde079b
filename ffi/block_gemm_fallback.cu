// A plain block-scaled FP8 GEMM for what cuBLASLt rejects (see block_gemm_cuda.h): 16 x 16
// outputs per CTA through shared memory, one float32 partial sum per 128-wide K block,
// scaled by the two blocks' scale_inv and added to a float32 accumulator. Correct for every
// shape; not fast (it is only taken when cuBLASLt reports no algorithm).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "block_gemm_cuda.h"

namespace jax_fp8 {
namespace {

constexpr int kT = 16;  // output tile side and K step

__device__ __forceinline__ float Fp8ToFloat(uint8_t v, bool e5m2) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(v, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

__device__ __forceinline__ float Scale(const float* s, bool tile, int64_t ld, int64_t row,
                                       int64_t kb) {
  return tile ? s[(row / 128) * ld + kb] : s[kb * ld + row];
}

__global__ void BlockGemmFallbackKernel(const BlockGemmArgs p) {
  __shared__ float as[kT][kT + 1];
  __shared__ float bs[kT][kT + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m = static_cast<int64_t>(blockIdx.y) * kT + ty;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kT + tx;
  const int64_t a_row = static_cast<int64_t>(blockIdx.y) * kT + tx;  // row this thread loads
  const int64_t b_row = static_cast<int64_t>(blockIdx.x) * kT + ty;
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < p.k; k0 += 128) {
    float partial = 0.0f;
    const int64_t k_end = k0 + 128 < p.k ? k0 + 128 : p.k;
    for (int64_t k1 = k0; k1 < k_end; k1 += kT) {
      // as[i][j] = a[tile row i, k1 + j]; bs[i][j] = b[tile col i, k1 + j]
      const int64_t ka = k1 + ty, kb = k1 + tx;
      as[tx][ty] = (a_row < p.m && ka < k_end) ? Fp8ToFloat(p.a[a_row * p.k + ka], p.a_e5m2) : 0.0f;
      bs[ty][tx] = (b_row < p.n && kb < k_end) ? Fp8ToFloat(p.b[b_row * p.k + kb], p.b_e5m2) : 0.0f;
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kT; ++j) partial += as[ty][j] * bs[tx][j];
      __syncthreads();
    }
    if (m < p.m && n < p.n) {
      const int64_t blk = k0 / 128;
      acc += partial * (Scale(p.a_scale, p.a_tile, p.a_scale_ld, m, blk) *
                        Scale(p.b_scale, p.b_tile, p.b_scale_ld, n, blk));
    }
  }
  if (m < p.m && n < p.n) {
    if (p.out_bf16) {
      static_cast<__nv_bfloat16*>(p.out)[m * p.n + n] = __float2bfloat16_rn(acc);
    } else {
      static_cast<float*>(p.out)[m * p.n + n] = acc;
    }
  }
}

}  // namespace

cudaError_t LaunchBlockGemmFallback(cudaStream_t stream, const BlockGemmArgs& args) {
  const int64_t gx = (args.n + kT - 1) / kT, gy = (args.m + kT - 1) / kT;
  if (gx > INT32_MAX || gy > 65535) return cudaErrorInvalidValue;
  BlockGemmFallbackKernel<<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                            dim3(kT, kT), 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_fp8
