// Blockwise FP8 quantization (see block_quantize_cuda.h): one CTA per 128 x 128 tile.
//
// A thread holds 16 rows x 4 columns of the tile in registers (warp w: rows 16w..16w+15,
// lane l: columns 4l..4l+3), so the tile is read once for every output:
// - a 1 x 128 block is a row of the tile: its amax is one warp max (__reduce_max_sync);
// - a column-wise block (128 rows of one column) is reduced over the thread's 16 rows,
//   then over the 8 warps through shared memory;
// - a 128 x 128 tile is the max over the CTA.
// Row-wise bytes are stored from registers (a warp writes 128 contiguous bytes of a row);
// column-wise bytes go through an XOR-swizzled shared tile, so a warp also writes 128
// contiguous bytes of a q_t row, without bank conflicts in either phase. The amax is a
// max over the bits of |x| with NaN read as 0 (SPEC.md: fmaxf from 0, NaN ignored), the
// scale arithmetic is IEEE float32 (no flush-to-zero, correctly rounded division), so the
// bits are those of the jax.numpy reference (jax_fp8/_primitives/block_quantize.py).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "block_quantize_cuda.h"
#include "scaling_math.h"

namespace jax_fp8 {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kTile / kWarps;  // 16
constexpr int64_t kMaxGridY = 65535;

struct Smem {
  uint32_t tile[kTile][kTile / 4];  // column-wise bytes: row o is tile column o, swizzled
  uint32_t col_max[kWarps][kTile];  // per-warp column amax bits
  uint32_t warp_max[kWarps];
};

// Four consecutive values of a row as loaded (16-bit types stay packed, which halves the
// registers the tile takes); get(j) widens value j to float32, exactly.
template <typename In>
struct Group4;
template <>
struct Group4<float> {
  float v[4];
  __device__ __forceinline__ float get(int j) const { return v[j]; }
};
template <typename In>
struct Group4Half {
  uint32_t w[2];
  __device__ __forceinline__ uint32_t raw(int j) const { return (w[j / 2] >> (16 * (j % 2))) & 0xFFFFu; }
};
template <>
struct Group4<__nv_bfloat16> : Group4Half<__nv_bfloat16> {
  __device__ __forceinline__ float get(int j) const { return __uint_as_float(raw(j) << 16); }
};
template <>
struct Group4<__half> : Group4Half<__half> {
  __device__ __forceinline__ float get(int j) const {
    const uint32_t h = raw(j);
    if ((h & 0x7C00u) == 0x7C00u) {  // inf / NaN on bits: keeps a NaN's sign and payload
      return __uint_as_float(((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x3FFu) << 13));
    }
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  }
};

// Up to 4 consecutive elements of a row (zeros past n_valid). `vec`: cols % 4 == 0, so a
// group is whole or absent and loads as one vector.
template <typename In>
__device__ __forceinline__ Group4<In> Load4(const In* __restrict__ p, int n_valid, bool vec) {
  Group4<In> g{};
  if constexpr (sizeof(In) == 4) {
    if (vec && n_valid == 4) {
      const float4 w = *reinterpret_cast<const float4*>(p);
      g.v[0] = w.x, g.v[1] = w.y, g.v[2] = w.z, g.v[3] = w.w;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) g.v[j] = j < n_valid ? p[j] : 0.0f;
    }
  } else {
    if (vec && n_valid == 4) {
      const uint2 w = *reinterpret_cast<const uint2*>(p);
      g.w[0] = w.x, g.w[1] = w.y;
    } else {
      const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < n_valid) g.w[j / 2] |= static_cast<uint32_t>(q[j]) << (16 * (j % 2));
      }
    }
  }
  return g;
}

// |x| as bits, NaN as 0: the unsigned order of these is the order of the values.
__device__ __forceinline__ uint32_t AbsBits(float x) {
  const uint32_t u = __float_as_uint(x) & 0x7FFFFFFFu;
  return u > 0x7F800000u ? 0u : u;
}

// SPEC.md "Scale from an amax" (Transformer Engine's compute_scale_from_amax).
__device__ __forceinline__ float ScaleFromAmax(float amax, float fp8_max, float epsilon,
                                               bool power_of_2) {
  if (amax < epsilon) amax = epsilon;
  float s = (is_nan(amax) || is_inf(amax) || amax == 0.0f) ? 1.0f : fp8_max / amax;
  if (is_inf(s)) s = bits_float(kFltMaxBits);
  if (power_of_2) s = bits_float(float_bits(s) & kPow2Mask);
  return s;
}

// saturate_cast(x * s): clip to +-fp8_max in float32, round to nearest even. A NaN x gives
// the format's quiet NaN with x's sign (0x7F / 0x7E, sign bit 0x80), as the reference.
template <Fp8Type kFp8>
__device__ __forceinline__ uint32_t QuantizeByte(float x, float s, float fp8_max) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return ((u >> 24) & 0x80u) | (kFp8 == Fp8Type::kE5M2 ? 0x7Eu : 0x7Fu);
  }
  float y = x * s;
  y = y > fp8_max ? fp8_max : (y < -fp8_max ? -fp8_max : y);
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, kFp8 == Fp8Type::kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

// Up to 4 bytes at q[offset..]: one 32-bit store when `vec` (the group is whole and aligned).
__device__ __forceinline__ void Store4(uint8_t* q, int64_t offset, uint32_t word, int n_valid,
                                       bool vec) {
  if (n_valid <= 0) return;
  if (vec) {
    *reinterpret_cast<uint32_t*>(q + offset) = word;
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < n_valid) q[offset + j] = static_cast<uint8_t>(word >> (8 * j));
  }
}

__device__ __forceinline__ int Clamp4(int64_t n) {
  return n <= 0 ? 0 : (n >= 4 ? 4 : static_cast<int>(n));
}

// The column-wise bytes of the thread's 16 x 4 values into the shared tile: tile column
// 4 lane + j becomes tile row o, whose word W (tile rows 4W..4W+3) is stored at W ^ (o / 4).
template <typename In, Fp8Type kFp8>
__device__ __forceinline__ void StoreColumns(Smem& sm, const Group4<In> (&v)[kRowsPerWarp],
                                             const float (&s)[4], float fp8_max, int warp,
                                             int lane) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        word |= QuantizeByte<kFp8>(v[4 * q + k].get(j), s[j], fp8_max) << (8 * k);
      }
      sm.tile[4 * lane + j][(4 * warp + q) ^ lane] = word;
    }
  }
}

template <typename In, Fp8Type kFp8>
__global__ void __launch_bounds__(kThreads, 2)  // two CTAs (16 warps) per SM
    BlockQuantizeKernel(const BlockQuantizeArgs a, int64_t row_tiles, float fp8_max) {
  __shared__ Smem sm;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const In* __restrict__ x = static_cast<const In*>(a.x);
  uint8_t* q = static_cast<uint8_t*>(a.q);
  uint8_t* q_t = static_cast<uint8_t*>(a.q_t);
  const int64_t rows = a.rows, cols = a.cols;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  const int64_t kb = blockIdx.x;
  const int64_t col0 = kb * kTile;
  const int64_t c = col0 + 4 * lane;
  const int n_cols = Clamp4(cols - c);
  const bool vec_rows = cols % 4 == 0;  // whole groups along a row: vector loads, word stores
  const bool vec_cols = rows % 4 == 0;  // whole groups along a q_t row: word stores
  for (int64_t t = blockIdx.y; t < a.batch * row_tiles; t += gridDim.y) {
    const int64_t b = t / row_tiles, mb = t % row_tiles, row0 = mb * kTile;
    const In* xb = x + b * rows * cols;
    Group4<In> v[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t r = row0 + warp * kRowsPerWarp + i;
      v[i] = Load4<In>(xb + r * cols + c, r < rows ? n_cols : 0, vec_rows);
    }
    uint32_t row_max[kRowsPerWarp], col_max[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      row_max[i] = 0u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t m = AbsBits(v[i].get(j));
        row_max[i] = max(row_max[i], m);
        col_max[j] = max(col_max[j], m);
      }
    }
    float s_col[4];
    if (a.tile_2d) {
      uint32_t m = max(max(col_max[0], col_max[1]), max(col_max[2], col_max[3]));
      m = __reduce_max_sync(0xFFFFFFFFu, m);
      if (lane == 0) sm.warp_max[warp] = m;
      __syncthreads();
      m = 0u;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m = max(m, sm.warp_max[w]);
      const float s = ScaleFromAmax(__uint_as_float(m), fp8_max, a.amax_epsilon,
                                    a.power_of_2_scale);
      if (threadIdx.x == 0) {
        const float inv = scale_inverse(s);
        if (q) a.scale_inv[(b * row_tiles + mb) * col_tiles + kb] = inv;
        if (q_t) a.scale_inv_t[(b * col_tiles + kb) * row_tiles + mb] = inv;
      }
      if (q) {
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const int64_t r = row0 + warp * kRowsPerWarp + i;
          uint32_t word = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) word |= QuantizeByte<kFp8>(v[i].get(j), s, fp8_max) << (8 * j);
          Store4(q, (b * rows + r) * cols + c, word, r < rows ? n_cols : 0, vec_rows);
        }
      }
      s_col[0] = s_col[1] = s_col[2] = s_col[3] = s;
    } else {
      if (q) {
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const int64_t r = row0 + warp * kRowsPerWarp + i;
          const uint32_t m = __reduce_max_sync(0xFFFFFFFFu, row_max[i]);
          const float s = ScaleFromAmax(__uint_as_float(m), fp8_max, a.amax_epsilon,
                                        a.power_of_2_scale);
          if (lane == 0 && r < rows) a.scale_inv[(b * rows + r) * col_tiles + kb] = scale_inverse(s);
          uint32_t word = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) word |= QuantizeByte<kFp8>(v[i].get(j), s, fp8_max) << (8 * j);
          Store4(q, (b * rows + r) * cols + c, word, r < rows ? n_cols : 0, vec_rows);
        }
      }
      if (q_t) {
#pragma unroll
        for (int j = 0; j < 4; ++j) sm.col_max[warp][4 * lane + j] = col_max[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t m = 0u;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) m = max(m, sm.col_max[w][4 * lane + j]);
          s_col[j] = ScaleFromAmax(__uint_as_float(m), fp8_max, a.amax_epsilon,
                                   a.power_of_2_scale);
          if (warp == 0 && j < n_cols) {
            a.scale_inv_t[(b * cols + c + j) * row_tiles + mb] = scale_inverse(s_col[j]);
          }
        }
      }
    }
    if (q_t) {
      StoreColumns<In, kFp8>(sm, v, s_col, fp8_max, warp, lane);
      __syncthreads();
      const int n_rows = Clamp4(rows - (row0 + 4 * lane));
#pragma unroll 4
      for (int o = warp; o < kTile; o += kWarps) {
        if (col0 + o >= cols) break;  // warp-uniform
        const uint32_t word = sm.tile[o][lane ^ ((o / 4) % 32)];
        Store4(q_t, (b * cols + col0 + o) * rows + row0 + 4 * lane, word, n_rows, vec_cols);
      }
    }
    __syncthreads();  // shared memory is reused by the next tile
  }
}

template <typename In, Fp8Type kFp8>
cudaError_t LaunchTyped(cudaStream_t stream, const BlockQuantizeArgs& a) {
  const int64_t row_tiles = (a.rows + kTile - 1) / kTile;
  const int64_t col_tiles = (a.cols + kTile - 1) / kTile;
  const int64_t grid_y = a.batch * row_tiles < kMaxGridY ? a.batch * row_tiles : kMaxGridY;
  const float fp8_max = kFp8 == Fp8Type::kE5M2 ? 57344.0f : 448.0f;
  BlockQuantizeKernel<In, kFp8>
      <<<dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(grid_y)), kThreads, 0,
         stream>>>(a, row_tiles, fp8_max);
  return cudaGetLastError();
}

template <typename In>
cudaError_t LaunchForFp8(cudaStream_t stream, const BlockQuantizeArgs& a) {
  return a.fp8_type == Fp8Type::kE5M2 ? LaunchTyped<In, Fp8Type::kE5M2>(stream, a)
                                      : LaunchTyped<In, Fp8Type::kE4M3FN>(stream, a);
}

}  // namespace

bool BlockQuantizeSupports(int64_t batch, int64_t rows, int64_t cols) {
  return batch >= 1 && rows >= 1 && cols >= 1 && (cols + kTile - 1) / kTile <= INT32_MAX &&
         batch <= INT64_MAX / rows / cols;
}

cudaError_t LaunchBlockQuantize(cudaStream_t stream, const BlockQuantizeArgs& a) {
  if (!BlockQuantizeSupports(a.batch, a.rows, a.cols) || (!a.q && !a.q_t)) {
    return cudaErrorInvalidValue;
  }
  switch (a.in_type) {
    case InType::kF32: return LaunchForFp8<float>(stream, a);
    case InType::kBF16: return LaunchForFp8<__nv_bfloat16>(stream, a);
    case InType::kF16: return LaunchForFp8<__half>(stream, a);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jax_fp8
