// FP8 transposes, one 128 x 128-byte tile per block (see transpose_cuda.h).
//
// Why not XLA's own: its transpose of 1-byte elements runs well below a copy of the same
// bytes (docs/benchmarks.md), and it reads the quantized tensor back from memory. Here
// every global access is coalesced: a warp
// reads 128 contiguous bytes (32-bit words) of each of 4 rows, the 4 x 4 byte blocks
// are transposed in registers (__byte_perm), and the tile goes through shared memory
// so that a warp also writes 128 contiguous bytes of an output row. The shared tile is
// XOR-swizzled so neither phase has bank conflicts. The quantizing variant does the
// cast (and the amax) on the way in, so the tensor is read once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "transpose_cuda.h"
#include "type_dispatch.h"

namespace jax_fp8 {
namespace {

constexpr int kTileBytes = 128;             // tile side, in bytes (rows and columns)
constexpr int kTileWords = kTileBytes / 4;  // 32: one word per lane
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kQuadsPerWarp = kTileBytes / 4 / kWarps;  // 4 groups of 4 rows each
constexpr int64_t kMaxGridYZ = 65535;

// The tile as output rows: tile[o][w ^ swizzle(o)] is word w (4 input rows) of output row
// o (an input column); swizzle(o) = o / 4 % 32 is the lane that wrote row o.
struct Tile {
  uint32_t words[kTileBytes][kTileWords];
};

// v[k] holds 4 bytes of input row k (columns 4 lane .. 4 lane + 3); stores them as 4
// words of output rows 4 lane + j, at word q of those rows.
__device__ __forceinline__ void StoreTransposed4x4(Tile& tile, const uint32_t v[4], int q,
                                                   int lane) {
  const uint32_t lo01 = __byte_perm(v[0], v[1], 0x5140);  // r0c0 r1c0 r0c1 r1c1
  const uint32_t hi01 = __byte_perm(v[0], v[1], 0x7362);  // r0c2 r1c2 r0c3 r1c3
  const uint32_t lo23 = __byte_perm(v[2], v[3], 0x5140);
  const uint32_t hi23 = __byte_perm(v[2], v[3], 0x7362);
  tile.words[4 * lane + 0][q ^ lane] = __byte_perm(lo01, lo23, 0x5410);  // column 0: r0..r3
  tile.words[4 * lane + 1][q ^ lane] = __byte_perm(lo01, lo23, 0x7632);
  tile.words[4 * lane + 2][q ^ lane] = __byte_perm(hi01, hi23, 0x5410);
  tile.words[4 * lane + 3][q ^ lane] = __byte_perm(hi01, hi23, 0x7632);
}

// Phase 2 (after __syncthreads): a warp writes one output row (128 bytes) per step.
__device__ __forceinline__ void WriteTile(const Tile& tile, uint32_t* dst, int64_t row0,
                                          int64_t col0, int64_t rows, int64_t cols, int warp,
                                          int lane) {
  const int64_t out_words = rows / 4;
  const int64_t out_word = row0 / 4 + lane;
#pragma unroll 4
  for (int o = warp; o < kTileBytes; o += kWarps) {
    const int64_t out_row = col0 + o;
    if (out_row < cols && out_word < out_words) {
      dst[out_row * out_words + out_word] = tile.words[o][lane ^ ((o / 4) % 32)];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    TransposeBytesKernel(const uint32_t* __restrict__ in, uint32_t* __restrict__ out, int64_t rows,
                         int64_t cols) {
  __shared__ Tile tile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t in_words = cols / 4;
  const int64_t batch = blockIdx.z;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileBytes;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileBytes;
  const uint32_t* src = in + batch * rows * in_words;
  const int64_t in_word = col0 / 4 + lane;
  uint32_t v[kQuadsPerWarp][4];  // all loads first: 16 words in flight per thread
#pragma unroll
  for (int i = 0; i < kQuadsPerWarp; ++i) {
    const int64_t r = row0 + 4 * (warp + i * kWarps);
    const bool inside = r < rows && in_word < in_words;  // rows % 4 == 0: r + 3 < rows
    const uint32_t* p = src + r * in_words + in_word;
#pragma unroll
    for (int k = 0; k < 4; ++k) v[i][k] = inside ? p[k * in_words] : 0u;
  }
#pragma unroll
  for (int i = 0; i < kQuadsPerWarp; ++i) StoreTransposed4x4(tile, v[i], warp + i * kWarps, lane);
  __syncthreads();
  WriteTile(tile, out + batch * cols * (rows / 4), row0, col0, rows, cols, warp, lane);
}

// Four consecutive elements of a row: loaded as one vector (Raw), then widened to
// float32 (exactly).
template <typename In>
struct Row4;
template <>
struct Row4<float> {
  using Raw = float4;
  __device__ static void Widen(const Raw& v, float f[4]) {
    f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
  }
};
template <>
struct Row4<__nv_bfloat16> {
  using Raw = uint2;
  __device__ static void Widen(const Raw& v, float f[4]) {
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&v.x);
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&v.y);
    f[0] = __low2float(a), f[1] = __high2float(a), f[2] = __low2float(b), f[3] = __high2float(b);
  }
};
template <>
struct Row4<__half> {
  using Raw = uint2;
  __device__ static void Widen(const Raw& v, float f[4]) {
    const __half2 a = *reinterpret_cast<const __half2*>(&v.x);
    const __half2 b = *reinterpret_cast<const __half2*>(&v.y);
    f[0] = __low2float(a), f[1] = __high2float(a), f[2] = __low2float(b), f[3] = __high2float(b);
  }
};

// jax_fp8.quantize for one value: clip(x * scale, -fp8_max, fp8_max) (NaN passes the
// clip, as jnp.clip's max/min propagate it), then round to nearest even.
template <Fp8Type kFp8>
__device__ __forceinline__ uint32_t QuantizeByte(float x, float scale, float fp8_max) {
  float y = x * scale;
  y = y > fp8_max ? fp8_max : (y < -fp8_max ? -fp8_max : y);
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, kFp8 == Fp8Type::kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

template <typename In, Fp8Type kFp8>
__global__ void __launch_bounds__(kThreads)
    QuantizeTransposeKernel(const In* __restrict__ x, const float* __restrict__ scale_ptr,
                            uint32_t* __restrict__ q, uint32_t* __restrict__ q_t,
                            unsigned int* __restrict__ amax_bits, int64_t rows, int64_t cols,
                            float fp8_max) {
  __shared__ Tile tile;
  __shared__ unsigned int warp_max[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Matrix blockIdx.z of the batch: its own scale and amax.
  const int64_t batch = blockIdx.z;
  x += batch * rows * cols;
  q += batch * rows * (cols / 4);
  q_t += batch * cols * (rows / 4);
  amax_bits += batch;
  const float scale = scale_ptr[batch];
  const int64_t in_words = cols / 4;  // groups of 4 elements = words of q
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileBytes;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileBytes;
  const int64_t in_word = col0 / 4 + lane;
  // max |x| as the bits of a non-negative float: their unsigned order is the float order,
  // and a NaN (sign cleared) is above infinity, so a NaN anywhere gives a NaN.
  using Raw = typename Row4<In>::Raw;
  Raw raw[kQuadsPerWarp][4];  // all loads first: 16 vectors in flight per thread
#pragma unroll
  for (int i = 0; i < kQuadsPerWarp; ++i) {
    const int64_t r = row0 + 4 * (warp + i * kWarps);
    const bool inside = r < rows && in_word < in_words;  // rows % 4 == 0: r + 3 < rows
    const Raw* p = reinterpret_cast<const Raw*>(x + r * cols) + in_word;
#pragma unroll
    for (int k = 0; k < 4; ++k) raw[i][k] = inside ? p[k * in_words] : Raw{};
  }
  unsigned int local_max = 0;
  uint32_t v[kQuadsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kQuadsPerWarp; ++i) {
    const int64_t r = row0 + 4 * (warp + i * kWarps);
    const bool inside = r < rows && in_word < in_words;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float f[4];
      Row4<In>::Widen(raw[i][k], f);
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        word |= static_cast<uint32_t>(QuantizeByte<kFp8>(f[j], scale, fp8_max)) << (8 * j);
        local_max = max(local_max, __float_as_uint(fabsf(f[j])));  // zeros outside
      }
      if (inside) q[(r + k) * in_words + in_word] = word;
      v[i][k] = word;
    }
  }
#pragma unroll
  for (int i = 0; i < kQuadsPerWarp; ++i) StoreTransposed4x4(tile, v[i], warp + i * kWarps, lane);
  local_max = __reduce_max_sync(0xffffffffu, local_max);
  if (lane == 0) warp_max[warp] = local_max;
  __syncthreads();
  WriteTile(tile, q_t, row0, col0, rows, cols, warp, lane);
  if (threadIdx.x == 0) {
    unsigned int m = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, warp_max[w]);
    if (m != 0) atomicMax(amax_bits, m);
  }
}

dim3 TileGrid(int64_t batch, int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>((cols + kTileBytes - 1) / kTileBytes),
              static_cast<unsigned>((rows + kTileBytes - 1) / kTileBytes),
              static_cast<unsigned>(batch));
}

template <typename In, Fp8Type kFp8>
cudaError_t LaunchQuantizeTransposeTyped(cudaStream_t stream, const void* x, const float* scale,
                                         void* q, void* q_t, float* amax, int64_t batch,
                                         int64_t rows, int64_t cols, float fp8_max) {
  QuantizeTransposeKernel<In, kFp8><<<TileGrid(batch, rows, cols), kThreads, 0, stream>>>(
      static_cast<const In*>(x), scale, static_cast<uint32_t*>(q), static_cast<uint32_t*>(q_t),
      reinterpret_cast<unsigned int*>(amax), rows, cols, fp8_max);
  return cudaGetLastError();
}

}  // namespace

bool TransposeBytesSupports(int64_t batch, int64_t rows, int64_t cols) {
  return batch >= 1 && rows >= 1 && cols >= 1 && rows % 4 == 0 && cols % 4 == 0 &&
         batch <= kMaxGridYZ && (rows + kTileBytes - 1) / kTileBytes <= kMaxGridYZ &&
         (cols + kTileBytes - 1) / kTileBytes <= INT32_MAX;
}

cudaError_t LaunchTransposeBytes(cudaStream_t stream, const void* in, void* out, int64_t batch,
                                 int64_t rows, int64_t cols) {
  if (!TransposeBytesSupports(batch, rows, cols)) return cudaErrorInvalidValue;
  TransposeBytesKernel<<<TileGrid(batch, rows, cols), kThreads, 0, stream>>>(
      static_cast<const uint32_t*>(in), static_cast<uint32_t*>(out), rows, cols);
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeTranspose(cudaStream_t stream, InType in_type, Fp8Type fp8_type,
                                    const void* x, const float* scale, void* q, void* q_t,
                                    float* amax, int64_t batch, int64_t rows, int64_t cols,
                                    float fp8_max) {
  if (!TransposeBytesSupports(batch, rows, cols)) return cudaErrorInvalidValue;
  // Each amax is an atomic max over its matrix's blocks, from zero (max |x| >= 0).
  cudaError_t err = cudaMemsetAsync(amax, 0, batch * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  return DispatchTypes(in_type, fp8_type, cudaErrorInvalidValue, [&](auto in, auto fp8) {
    return LaunchQuantizeTransposeTyped<typename decltype(in)::type, decltype(fp8)::value>(
        stream, x, scale, q, q_t, amax, batch, rows, cols, fp8_max);
  });
}

}  // namespace jax_fp8
