// Blockwise FP8 quantization (see block_quantize_cuda.h): one CTA of 256 threads per
// 128 x 128 tile of x, which it reads once for every output it writes.
//
// Design (memory-bound: x is read once, every byte written once, with few instructions
// per element, so that the kernel runs at the speed of DRAM):
// - Thread (warp w, lane l) holds rows 16w..16w+15, columns 4l..4l+3 of the tile in
//   registers as loaded (16-bit types stay packed): 16 loads of 8 bytes (16 for
//   float32), all issued before any is used; a warp's load is 256 (512) contiguous bytes.
// - Amaxes are integer maxima of the bits of |x| in the input format (their order is
//   the order of the values), two 16-bit values per instruction (VIMNMX.U16x2): a row's
//   1 x 128 block is one warp max (__reduce_max_sync), a column's 128 x 1 block a max
//   over the thread's 16 rows, then over the 8 warps through shared memory, a 128 x 128
//   tile the max over the CTA. A NaN has bits above inf's, so the maxima say for free
//   whether the tile holds a NaN; only such a tile (one CTA-uniform branch) recomputes
//   its maxima with NaN read as 0 and patches the NaN bytes (docs/semantics.md: fmaxf from 0, NaN
//   ignored; a NaN quantizes to the type's quiet NaN with x's sign).
// - The 256 scales of a tile (128 row blocks, 128 column blocks) are computed by one
//   thread each (one IEEE division per thread) and shared through shared memory;
//   scale_inv is written by those threads, contiguous in memory in the layout the block
//   GEMM (cuBLASLt) reads when `gemm_layout` (pads included), so no XLA op transposes
//   or pads it afterwards.
// - x * s is converted two values per instruction (cvt.rn.satfinite.e4m3x2/e5m2x2.f32,
//   which saturates exactly as clip-to-fp8_max then round-to-nearest-even does; the
//   second conversion of a word merges into the first's register).
// - Row-wise bytes go from registers to global memory (a warp stores 128 contiguous
//   bytes of a row). Column-wise bytes are packed in registers as 4 rows of one column
//   (2-D tiles: a 4 x 4 byte transpose of the row-wise words, PRMT), stored as one
//   16-byte chunk per column into a shared tile swizzled at 16-byte granularity (chunk
//   c of row o at c ^ ((o / 4) % 8): no bank conflicts when written by column or read by
//   row), then read back by rows and written with 16-byte stores (8 threads per 128-byte
//   q_t row).
// - Edge tiles: loads past the array read zeros (they change no max from 0), stores
//   past it are skipped; vector loads and stores only where sizes and pointers align.
//   Whole tiles take a branch-free path (16 vector loads, 16 word stores).
// - Grid: one CTA per tile, (column tiles, row tiles x batch over y and z); 18 KB of
//   shared memory, 64 registers (16-bit inputs: 4 CTAs, 128 KB of loads in flight per
//   SM; ptxas spills two invariant words) or 128 (float32: 2 CTAs, no spills). A 1 x 128,
//   both-layouts pass moves the input once, both FP8 copies once and the scales, with
//   ~14 instructions per element: memory-bound.
// The scale arithmetic is IEEE float32 (no flush-to-zero, correctly rounded division), so
// the bits are those of the jax.numpy reference (jax_fp8/_primitives/exact.py).
// tests/kernels/test_block_quantize_host.py compiles this file for the host
// (tests/kernels/cuda/host_cuda.h: CUDA threads as fibers, the conversions as the PTX ISA
// specifies them) and checks its bits against that reference without a GPU; it rewrites
// the one __shared__ declaration and the two launches below, so keep them in their present
// form.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "block_quantize_cuda.h"
#include "block_scale_layout.h"
#include "scaling_math.h"
#include "type_dispatch.h"

namespace jax_fp8 {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = kTile / kWarps;  // rows per warp (and per thread): 16
constexpr int64_t kMaxGridY = 65535;

// The input types: 32-bit words per 4 values, |x| mask and inf in the input's bits.
template <typename In>
struct In4;
template <>
struct In4<float> {
  static constexpr int kWords = 4;
  static constexpr uint32_t kAbs = 0x7FFFFFFFu, kInf = 0x7F800000u, kSign = 0x80000000u;
  static constexpr int kBits = 32;
};
template <>
struct In4<__nv_bfloat16> {
  static constexpr int kWords = 2;
  static constexpr uint32_t kAbs = 0x7FFFu, kInf = 0x7F80u, kSign = 0x8000u;
  static constexpr int kBits = 16;
};
template <>
struct In4<__half> {
  static constexpr int kWords = 2;
  static constexpr uint32_t kAbs = 0x7FFFu, kInf = 0x7C00u, kSign = 0x8000u;
  static constexpr int kBits = 16;
};

// The bits of value j (0..3) of a group of four consecutive values of a row.
template <typename In>
__device__ __forceinline__ uint32_t Raw(const uint32_t* w, int j) {
  if constexpr (In4<In>::kBits == 32) {
    return w[j];
  } else {
    return (j % 2) ? (w[j / 2] >> 16) : (w[j / 2] & 0xFFFFu);
  }
}

// The input-format bits of a value (never NaN here) as float32, exactly.
template <typename In>
__device__ __forceinline__ float Widen(uint32_t bits) {
  if constexpr (In4<In>::kBits == 32) {
    return __uint_as_float(bits);
  } else if constexpr (sizeof(In) == 2 && In4<In>::kInf == 0x7F80u) {  // bfloat16
    return __uint_as_float(bits << 16);
  } else {  // float16: cvt.f32.f16 is exact, subnormals included
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
}

// Value j of a group as float32 (bfloat16: one shift or one and).
template <typename In>
__device__ __forceinline__ float Value(const uint32_t* w, int j) {
  if constexpr (In4<In>::kBits == 16 && In4<In>::kInf == 0x7F80u) {
    return __uint_as_float((j % 2) ? (w[j / 2] & 0xFFFF0000u) : (w[j / 2] << 16));
  } else {
    return Widen<In>(Raw<In>(w, j));
  }
}

// |x| bits of one value, NaN read as 0 (the tiles that hold a NaN).
template <typename In>
__device__ __forceinline__ uint32_t MaskedAbs(uint32_t raw) {
  const uint32_t a = raw & In4<In>::kAbs;
  return a > In4<In>::kInf ? 0u : a;
}

// Up to 4 consecutive values of a row (zeros past n_valid), as 32-bit words; `vec`: one
// vector load of a whole aligned group.
template <typename In>
__device__ __forceinline__ void Load4(const In* __restrict__ p, int n_valid, bool vec,
                                      uint32_t (&w)[In4<In>::kWords]) {
  if constexpr (In4<In>::kBits == 32) {
    if (vec && n_valid == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = j < n_valid ? q[j] : 0u;
    }
  } else {
    if (vec && n_valid == 4) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = v.x, w[1] = v.y;
    } else {
      const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
      w[0] = w[1] = 0u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < n_valid) w[j / 2] |= static_cast<uint32_t>(q[j]) << (16 * (j % 2));
      }
    }
  }
}

// docs/semantics.md, "Scale from an amax" (Transformer Engine's compute_scale_from_amax).
__device__ __forceinline__ float ScaleFromAmax(float amax, float fp8_max, float epsilon,
                                               bool power_of_2) {
  if (amax < epsilon) amax = epsilon;
  float s = (is_nan(amax) || is_inf(amax) || amax == 0.0f) ? 1.0f : fp8_max / amax;
  if (is_inf(s)) s = bits_float(kFltMaxBits);
  if (power_of_2) s = bits_float(float_bits(s) & kPow2Mask);
  return s;
}

// saturate_cast of two products, round to nearest even: lo in the low byte.
template <Fp8Type kFp8>
__device__ __forceinline__ uint32_t Cvt2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE,
                                  kFp8 == Fp8Type::kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

// Replaces the bytes of NaN inputs by the type's quiet NaN with the input's sign
// (0x7F / 0x7E, sign bit 0x80), as the reference.
template <typename In, Fp8Type kFp8>
__device__ __forceinline__ uint32_t FixNaN(uint32_t word, const uint32_t (&raw)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if ((raw[k] & In4<In>::kAbs) > In4<In>::kInf) {
      const uint32_t byte =
          (kFp8 == Fp8Type::kE5M2 ? 0x7Eu : 0x7Fu) | ((raw[k] & In4<In>::kSign) ? 0x80u : 0u);
      word = (word & ~(0xFFu << (8 * k))) | (byte << (8 * k));
    }
  }
  return word;
}

// The 4 bytes of a row group, one scale.
template <typename In, Fp8Type kFp8, bool kFixNaN>
__device__ __forceinline__ uint32_t QuantRow(const uint32_t (&w)[In4<In>::kWords], float s) {
  uint32_t word = Cvt2<kFp8>(Value<In>(w, 0) * s, Value<In>(w, 1) * s) |
                  (Cvt2<kFp8>(Value<In>(w, 2) * s, Value<In>(w, 3) * s) << 16);
  if constexpr (kFixNaN) {
    const uint32_t raw[4] = {Raw<In>(w, 0), Raw<In>(w, 1), Raw<In>(w, 2), Raw<In>(w, 3)};
    word = FixNaN<In, kFp8>(word, raw);
  }
  return word;
}

// The 4 bytes of column j over rows 4q..4q+3 of the thread's rows, one scale.
template <typename In, Fp8Type kFp8, bool kFixNaN>
__device__ __forceinline__ uint32_t QuantCol(const uint32_t (&v)[kRows][In4<In>::kWords], int q,
                                             int j, float s) {
  uint32_t word =
      Cvt2<kFp8>(Value<In>(v[4 * q], j) * s, Value<In>(v[4 * q + 1], j) * s) |
      (Cvt2<kFp8>(Value<In>(v[4 * q + 2], j) * s, Value<In>(v[4 * q + 3], j) * s) << 16);
  if constexpr (kFixNaN) {
    const uint32_t raw[4] = {Raw<In>(v[4 * q], j), Raw<In>(v[4 * q + 1], j),
                             Raw<In>(v[4 * q + 2], j), Raw<In>(v[4 * q + 3], j)};
    word = FixNaN<In, kFp8>(word, raw);
  }
  return word;
}

// The row maximum of |x| bits of a group, as a value whose unsigned order is that of the
// maxima (16-bit types: the max in both halves). kMask: NaN read as 0.
template <typename In, bool kMask>
__device__ __forceinline__ uint32_t GroupMax(const uint32_t (&w)[In4<In>::kWords]) {
  if constexpr (kMask) {
    uint32_t m = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) m = max(m, MaskedAbs<In>(Raw<In>(w, j)));
    return In4<In>::kBits == 16 ? (m | (m << 16)) : m;
  } else if constexpr (In4<In>::kBits == 32) {
    return max(max(w[0] & 0x7FFFFFFFu, w[1] & 0x7FFFFFFFu),
               max(w[2] & 0x7FFFFFFFu, w[3] & 0x7FFFFFFFu));
  } else {
    const uint32_t m = __vmaxu2(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu);
    return __vmaxu2(m, __byte_perm(m, 0u, 0x1032));  // max of the two halves, in both
  }
}

// The max in GroupMax's form as input-format bits.
template <typename In>
__device__ __forceinline__ uint32_t Unpack(uint32_t m) {
  return In4<In>::kBits == 16 ? (m & 0xFFFFu) : m;
}

// Column maxima over the thread's 16 rows: col[j] = max |x| bits of column j.
template <typename In, bool kMask>
__device__ __forceinline__ void ColumnMax(const uint32_t (&v)[kRows][In4<In>::kWords],
                                          uint32_t (&col)[4]) {
  if constexpr (kMask) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t m = 0u;
#pragma unroll
      for (int i = 0; i < kRows; ++i) m = max(m, MaskedAbs<In>(Raw<In>(v[i], j)));
      col[j] = m;
    }
  } else if constexpr (In4<In>::kBits == 32) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t m = 0u;
#pragma unroll
      for (int i = 0; i < kRows; ++i) m = max(m, v[i][j] & 0x7FFFFFFFu);
      col[j] = m;
    }
  } else {
    uint32_t m0 = 0u, m1 = 0u;  // columns (0, 1) and (2, 3), packed
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      m0 = __vmaxu2(m0, v[i][0] & 0x7FFF7FFFu);
      m1 = __vmaxu2(m1, v[i][1] & 0x7FFF7FFFu);
    }
    col[0] = m0 & 0xFFFFu, col[1] = m0 >> 16, col[2] = m1 & 0xFFFFu, col[3] = m1 >> 16;
  }
}

// A 4 x 4 byte transpose: r[k] holds bytes (row k, columns 0..3); c[j] gets (rows 0..3,
// column j).
__device__ __forceinline__ void Transpose4x4(const uint32_t (&r)[4], uint32_t (&c)[4]) {
  const uint32_t t0 = __byte_perm(r[0], r[1], 0x5140), t1 = __byte_perm(r[0], r[1], 0x7362);
  const uint32_t t2 = __byte_perm(r[2], r[3], 0x5140), t3 = __byte_perm(r[2], r[3], 0x7362);
  c[0] = __byte_perm(t0, t2, 0x5410), c[1] = __byte_perm(t0, t2, 0x7632);
  c[2] = __byte_perm(t1, t3, 0x5410), c[3] = __byte_perm(t1, t3, 0x7632);
}

// Up to 4 bytes at q + offset: one 32-bit store when `vec` (the group is whole and aligned).
__device__ __forceinline__ void Store4(uint8_t* q, int64_t offset, uint32_t word, int n_valid,
                                       bool vec) {
  if (n_valid <= 0) return;
  if (vec && n_valid == 4) {
    *reinterpret_cast<uint32_t*>(q + offset) = word;
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < n_valid) q[offset + j] = static_cast<uint8_t>(word >> (8 * j));
  }
}

// The thread's 16 row-wise words (a warp stores 128 contiguous bytes of each row).
__device__ __forceinline__ void StoreRows(uint8_t* q, int64_t b, int64_t rows, int64_t cols,
                                          int64_t r0, int64_t c, int n_cols, bool vec,
                                          const uint32_t (&word)[kRows]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t r = r0 + i;
    Store4(q, (b * rows + r) * cols + c, word[i], r < rows ? n_cols : 0, vec);
  }
}

// The same for a whole tile with aligned rows: 16 32-bit stores.
__device__ __forceinline__ void StoreRowsFull(uint8_t* q, int64_t b, int64_t rows, int64_t cols,
                                              int64_t r0, int64_t c,
                                              const uint32_t (&word)[kRows]) {
  uint8_t* dst = q + (b * rows + r0) * cols + c;
#pragma unroll
  for (int i = 0; i < kRows; ++i) *reinterpret_cast<uint32_t*>(dst + i * cols) = word[i];
}

__device__ __forceinline__ int Clamp(int64_t n, int hi) {
  return n <= 0 ? 0 : (n >= hi ? hi : static_cast<int>(n));
}

struct Smem {
  union {
    uint4 tile[kTile][kTile / 16];     // column-wise bytes: row o = tile column o, swizzled
    uint32_t col_part[kWarps][kTile];  // per-warp column amax bits (1-D blocks)
  } u;
  uint32_t row_amax[kTile];  // row amax bits (1-D blocks), GroupMax's form
  float row_scale[kTile];
  float col_scale[kTile];
  uint32_t warp_max[kWarps];  // 2-D tiles
};

// Where scale_inv of block (i, j) of one operand goes: the spec layout [.., I, J] or the
// block GEMM's (cuBLASLt's) layout of block_scale_layout.h (the padding holds 1.0).
struct ScaleOut {
  float* p;
  int64_t stride_i, stride_j, batch_stride;
};

// i counts rows (1-D) or row tiles (2-D) of an operand with `n_i` of them; j its K tiles.
inline ScaleOut MakeScaleOut(float* p, int64_t n_i, int64_t n_j, bool tile_2d, bool gemm) {
  if (!gemm) return {p, n_j, 1, n_i * n_j};
  const GemmScaleDims g =
      GemmScaleLayout(tile_2d ? n_i * kScaleBlock : n_i, n_j * kScaleBlock, tile_2d);
  if (tile_2d) return {p, g.ld, 1, g.outer * g.ld};
  return {p, 1, g.ld, g.outer * g.ld};
}

__device__ __forceinline__ void PutScale(const ScaleOut& o, int64_t b, int64_t i, int64_t j,
                                         float v) {
  o.p[b * o.batch_stride + i * o.stride_i + j * o.stride_j] = v;
}

struct Params {
  int64_t row_tiles, col_tiles;
  float fp8_max;
  bool vec_load, vec_q, vec_qt16, vec_qt4;
  ScaleOut s_row, s_col;
};

template <typename In, Fp8Type kFp8, bool kTile2d>
__global__ void __launch_bounds__(kThreads, In4<In>::kBits == 32 ? 2 : 4)
    BlockQuantizeKernel(const BlockQuantizeArgs a, const Params p) {
  constexpr int W = In4<In>::kWords;
  __shared__ Smem sm;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const In* __restrict__ x = static_cast<const In*>(a.x);
  uint8_t* q = static_cast<uint8_t*>(a.q);
  uint8_t* q_t = static_cast<uint8_t*>(a.q_t);
  const bool rowwise = q != nullptr, colwise = q_t != nullptr;
  const int64_t rows = a.rows, cols = a.cols;
  const int64_t kb = blockIdx.x, col0 = kb * kTile, c = col0 + 4 * lane;
  const int n_cols = Clamp(cols - c, 4);
  const bool gemm = a.gemm_layout;
  // One tile per CTA: (kb, t) with t = b * row_tiles + mb < 2**31 (BlockQuantizeSupports)
  // spread over the grid's y and z (at most 65535 each).
  const uint32_t t = blockIdx.z * gridDim.y + blockIdx.y;
  const uint32_t row_tiles = static_cast<uint32_t>(p.row_tiles);
  if (t >= static_cast<uint32_t>(a.batch) * row_tiles) return;  // CTA-uniform
  {
    const uint32_t b32 = t / row_tiles;
    const int64_t b = b32, mb = t - b32 * row_tiles, row0 = mb * kTile;
    const int64_t r0 = row0 + warp * kRows;  // the thread's first row
    const In* xb = x + b * rows * cols;
    // A whole tile with aligned rows (all but the edges): 16 vector loads, no branches.
    const bool full = row0 + kTile <= rows && col0 + kTile <= cols;
    uint32_t v[kRows][W];
    if (full && p.vec_load) {
      const In* src = xb + r0 * cols + c;
#pragma unroll
      for (int i = 0; i < kRows; ++i) Load4<In>(src + i * cols, 4, true, v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int64_t r = r0 + i;
        Load4<In>(xb + r * cols + c, r < rows ? n_cols : 0, p.vec_load, v[i]);
      }
    }
    bool has_nan;
    if constexpr (kTile2d) {
      // ------------------------------------------------------------ 128 x 128 tiles
      uint32_t m = 0u;
#pragma unroll
      for (int i = 0; i < kRows; ++i) m = max(m, GroupMax<In, false>(v[i]));
      const bool nan = Unpack<In>(m) > In4<In>::kInf;
      m = __reduce_max_sync(0xFFFFFFFFu, m);
      if (lane == 0) sm.warp_max[warp] = m;
      has_nan = __syncthreads_or(nan);
      if (has_nan) {  // CTA-uniform
        m = 0u;
#pragma unroll
        for (int i = 0; i < kRows; ++i) m = max(m, GroupMax<In, true>(v[i]));
        m = __reduce_max_sync(0xFFFFFFFFu, m);
        if (lane == 0) sm.warp_max[warp] = m;  // nobody has read the first values
        __syncthreads();
      }
      m = 0u;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m = max(m, sm.warp_max[w]);
      const float s =
          ScaleFromAmax(Widen<In>(Unpack<In>(m)), p.fp8_max, a.amax_epsilon, a.power_of_2_scale);
      if (tid == 0) {
        const float inv = scale_inverse(s);
        if (rowwise) {
          PutScale(p.s_row, b, mb, kb, inv);
          if (gemm && kb == p.col_tiles - 1) {
            for (int64_t j = p.col_tiles; j < RoundUp4(p.col_tiles); ++j) {
              PutScale(p.s_row, b, mb, j, 1.0f);
            }
          }
        }
        if (colwise) {
          PutScale(p.s_col, b, kb, mb, inv);
          if (gemm && mb == p.row_tiles - 1) {
            for (int64_t j = p.row_tiles; j < RoundUp4(p.row_tiles); ++j) {
              PutScale(p.s_col, b, kb, j, 1.0f);
            }
          }
        }
      }
      uint32_t row_word[kRows];  // the row-wise bytes, also transposed for the column copy
      if (has_nan) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) row_word[i] = QuantRow<In, kFp8, true>(v[i], s);
      } else {
#pragma unroll
        for (int i = 0; i < kRows; ++i) row_word[i] = QuantRow<In, kFp8, false>(v[i], s);
      }
      if (rowwise) {
        if (full && p.vec_q) {
          StoreRowsFull(q, b, rows, cols, r0, c, row_word);
        } else {
          StoreRows(q, b, rows, cols, r0, c, n_cols, p.vec_q, row_word);
        }
      }
      if (colwise) {  // tile column 4 lane + j, rows 16 warp .. +15: one 16-byte chunk
        uint32_t col_word[4][4];
#pragma unroll
        for (int g = 0; g < 4; ++g) {
          const uint32_t r4[4] = {row_word[4 * g], row_word[4 * g + 1], row_word[4 * g + 2],
                                  row_word[4 * g + 3]};
          uint32_t c4[4];
          Transpose4x4(r4, c4);
#pragma unroll
          for (int j = 0; j < 4; ++j) col_word[j][g] = c4[j];
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int o = 4 * lane + j;
          sm.u.tile[o][warp ^ ((o >> 2) & 7)] =
              make_uint4(col_word[j][0], col_word[j][1], col_word[j][2], col_word[j][3]);
        }
      }
    } else {
      // ------------------------------------------------------------ 1 x 128 blocks
      uint32_t row_m[kRows], col_m[4];
      uint32_t tmax = 0u;
      if (rowwise) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          row_m[i] = GroupMax<In, false>(v[i]);
          tmax = max(tmax, row_m[i]);
        }
        tmax = Unpack<In>(tmax);
      }
      if (colwise) {
        ColumnMax<In, false>(v, col_m);
        tmax = max(max(col_m[0], col_m[1]), max(col_m[2], col_m[3]));
      }
      const bool nan = tmax > In4<In>::kInf;
      // publish: row maxima (lane 0 of each warp), column partials (every thread)
      if (rowwise) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) row_m[i] = __reduce_max_sync(0xFFFFFFFFu, row_m[i]);
        if (lane == 0) {
#pragma unroll
          for (int i = 0; i < kRows; i += 4) {
            *reinterpret_cast<uint4*>(&sm.row_amax[warp * kRows + i]) =
                make_uint4(row_m[i], row_m[i + 1], row_m[i + 2], row_m[i + 3]);
          }
        }
      }
      if (colwise) {
        *reinterpret_cast<uint4*>(&sm.u.col_part[warp][4 * lane]) =
            make_uint4(col_m[0], col_m[1], col_m[2], col_m[3]);
      }
      has_nan = __syncthreads_or(nan);
      if (has_nan) {  // CTA-uniform: the maxima again, NaN read as 0
        if (rowwise) {
#pragma unroll
          for (int i = 0; i < kRows; ++i) {
            row_m[i] = __reduce_max_sync(0xFFFFFFFFu, GroupMax<In, true>(v[i]));
          }
        }
        if (colwise) ColumnMax<In, true>(v, col_m);
        if (rowwise && lane == 0) {
#pragma unroll
          for (int i = 0; i < kRows; i += 4) {
            *reinterpret_cast<uint4*>(&sm.row_amax[warp * kRows + i]) =
                make_uint4(row_m[i], row_m[i + 1], row_m[i + 2], row_m[i + 3]);
          }
        }
        if (colwise) {
          *reinterpret_cast<uint4*>(&sm.u.col_part[warp][4 * lane]) =
              make_uint4(col_m[0], col_m[1], col_m[2], col_m[3]);
        }
        __syncthreads();
      }
      // One scale per thread: threads 0..127 the tile's rows, 128..255 its columns.
      if (tid < kTile) {
        if (rowwise) {
          const float s = ScaleFromAmax(Widen<In>(Unpack<In>(sm.row_amax[tid])), p.fp8_max,
                                        a.amax_epsilon, a.power_of_2_scale);
          sm.row_scale[tid] = s;
          const int64_t r = row0 + tid;
          if (r < rows) {
            PutScale(p.s_row, b, r, kb, scale_inverse(s));
          } else if (gemm && r < RoundUp4(rows)) {
            PutScale(p.s_row, b, r, kb, 1.0f);
          }
        }
      } else if (colwise) {
        const int j = tid - kTile;
        uint32_t m = 0u;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = max(m, sm.u.col_part[w][j]);
        const float s = ScaleFromAmax(Widen<In>(m), p.fp8_max, a.amax_epsilon, a.power_of_2_scale);
        sm.col_scale[j] = s;
        const int64_t cc = col0 + j;
        if (cc < cols) {
          PutScale(p.s_col, b, cc, mb, scale_inverse(s));
        } else if (gemm && cc < RoundUp4(cols)) {
          PutScale(p.s_col, b, cc, mb, 1.0f);
        }
      }
      __syncthreads();  // scales visible; col_part is read (the tile may overwrite it)
      if (rowwise) {
        float s[kRows];
#pragma unroll
        for (int i = 0; i < kRows; i += 4) {
          const float4 f = *reinterpret_cast<const float4*>(&sm.row_scale[warp * kRows + i]);
          s[i] = f.x, s[i + 1] = f.y, s[i + 2] = f.z, s[i + 3] = f.w;
        }
        uint32_t row_word[kRows];
        if (has_nan) {
#pragma unroll
          for (int i = 0; i < kRows; ++i) row_word[i] = QuantRow<In, kFp8, true>(v[i], s[i]);
        } else {
#pragma unroll
          for (int i = 0; i < kRows; ++i) row_word[i] = QuantRow<In, kFp8, false>(v[i], s[i]);
        }
        if (full && p.vec_q) {
          StoreRowsFull(q, b, rows, cols, r0, c, row_word);
        } else {
          StoreRows(q, b, rows, cols, r0, c, n_cols, p.vec_q, row_word);
        }
      }
      if (colwise) {
        const float4 f = *reinterpret_cast<const float4*>(&sm.col_scale[4 * lane]);
        const float sc[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t wd[4];
          if (has_nan) {
#pragma unroll
            for (int g = 0; g < 4; ++g) wd[g] = QuantCol<In, kFp8, true>(v, g, j, sc[j]);
          } else {
#pragma unroll
            for (int g = 0; g < 4; ++g) wd[g] = QuantCol<In, kFp8, false>(v, g, j, sc[j]);
          }
          const int o = 4 * lane + j;
          sm.u.tile[o][warp ^ ((o >> 2) & 7)] = make_uint4(wd[0], wd[1], wd[2], wd[3]);
        }
      }
    }
    if (colwise) {
      __syncthreads();         // the shared tile is complete
      const int ch = tid % 8;  // 16-byte chunk of a q_t row: tile rows 16 ch .. 16 ch + 15
      const int64_t r = row0 + 16 * ch;
      const int n_bytes = Clamp(rows - r, 16);
#pragma unroll
      for (int pass = 0; pass < 4; ++pass) {
        const int o = pass * 32 + tid / 8;
        const int64_t cc = col0 + o;
        if (cc >= cols || n_bytes == 0) continue;
        const uint4 d = sm.u.tile[o][ch ^ ((o >> 2) & 7)];
        uint8_t* dst = q_t + (b * cols + cc) * rows + r;
        if (p.vec_qt16 && n_bytes == 16) {
          *reinterpret_cast<uint4*>(dst) = d;
        } else {
          const uint32_t wd[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) Store4(dst, 4 * k, wd[k], n_bytes - 4 * k, p.vec_qt4);
        }
      }
    }
  }
}

template <typename In, Fp8Type kFp8>
cudaError_t LaunchTyped(cudaStream_t stream, const BlockQuantizeArgs& a) {
  Params p{};
  p.row_tiles = (a.rows + kTile - 1) / kTile;
  p.col_tiles = (a.cols + kTile - 1) / kTile;
  p.fp8_max = kFp8 == Fp8Type::kE5M2 ? 57344.0f : 448.0f;
  auto aligned = [](const void* ptr, uintptr_t n) {
    return reinterpret_cast<uintptr_t>(ptr) % n == 0;
  };
  // Every row (q_t row) of every batch element starts aligned when the base is aligned
  // and the row length is a multiple of the group.
  p.vec_load = a.cols % 4 == 0 && aligned(a.x, 4 * sizeof(In));
  p.vec_q = a.cols % 4 == 0 && aligned(a.q, 4);
  p.vec_qt16 = a.rows % 16 == 0 && aligned(a.q_t, 16);
  p.vec_qt4 = a.rows % 4 == 0 && aligned(a.q_t, 4);
  const int64_t scale_rows = a.tile_2d ? p.row_tiles : a.rows;
  const int64_t scale_cols = a.tile_2d ? p.col_tiles : a.cols;
  p.s_row = MakeScaleOut(a.scale_inv, scale_rows, p.col_tiles, a.tile_2d, a.gemm_layout);
  p.s_col = MakeScaleOut(a.scale_inv_t, scale_cols, p.row_tiles, a.tile_2d, a.gemm_layout);
  const int64_t n_tiles = a.batch * p.row_tiles;
  const int64_t grid_y = n_tiles < kMaxGridY ? n_tiles : kMaxGridY;
  const int64_t grid_z = (n_tiles + grid_y - 1) / grid_y;
  if (grid_z > kMaxGridY) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.col_tiles), static_cast<unsigned>(grid_y),
                  static_cast<unsigned>(grid_z));
  if (a.tile_2d) {
    BlockQuantizeKernel<In, kFp8, true><<<grid, kThreads, 0, stream>>>(a, p);
  } else {
    BlockQuantizeKernel<In, kFp8, false><<<grid, kThreads, 0, stream>>>(a, p);
  }
  return cudaGetLastError();
}

}  // namespace

bool BlockQuantizeSupports(int64_t batch, int64_t rows, int64_t cols) {
  return batch >= 1 && rows >= 1 && cols >= 1 && (cols + kTile - 1) / kTile <= INT32_MAX &&
         batch <= INT64_MAX / rows / cols && batch <= INT32_MAX / ((rows + kTile - 1) / kTile);
}

cudaError_t LaunchBlockQuantize(cudaStream_t stream, const BlockQuantizeArgs& a) {
  if (!BlockQuantizeSupports(a.batch, a.rows, a.cols) || (!a.q && !a.q_t)) {
    return cudaErrorInvalidValue;
  }
  return DispatchTypes(a.in_type, a.fp8_type, cudaErrorInvalidValue, [&](auto in, auto fp8) {
    return LaunchTyped<typename decltype(in)::type, decltype(fp8)::value>(stream, a);
  });
}

}  // namespace jax_fp8
