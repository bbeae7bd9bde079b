// Byte-matrix transpose, one 128 x 128-byte tile per block (see transpose_cuda.h).
//
// Why not XLA's own: its transpose of 1-byte elements ran at ~2 TB/s on the H200, half
// of what a copy of the same bytes reaches. Here every global access is a coalesced
// 32-bit word: a warp reads 128 contiguous bytes of each of 4 input rows, transposes
// the 4 x 4 byte blocks in registers (__byte_perm), and the tile goes through shared
// memory so that a warp also writes 128 contiguous bytes of an output row. The shared
// tile is XOR-swizzled so neither phase has bank conflicts.
#include "transpose_cuda.h"

namespace jax_fp8 {
namespace {

constexpr int kTileBytes = 128;             // tile side, in bytes (input rows and columns)
constexpr int kTileWords = kTileBytes / 4;  // 32: one word per lane
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kQuadsPerWarp = kTileBytes / 4 / kWarps;  // 4 groups of 4 input rows each
constexpr int64_t kMaxGridYZ = 65535;

__global__ void __launch_bounds__(kThreads)
    TransposeBytesKernel(const uint32_t* __restrict__ in, uint32_t* __restrict__ out,
                         int64_t rows, int64_t cols) {
  // tile[o][w ^ swizzle(o)]: output row o of the tile (an input column), word w of it
  // (4 input rows). swizzle(o) = o / 4 % 32, the lane that wrote row o.
  __shared__ uint32_t tile[kTileBytes][kTileWords];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t in_words = cols / 4;   // words per input row
  const int64_t out_words = rows / 4;  // words per output row
  const int64_t batch = blockIdx.z;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileBytes;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTileBytes;
  const uint32_t* src = in + batch * rows * in_words;
  uint32_t* dst = out + batch * cols * out_words;

  // Phase 1: all loads first (16 words in flight per thread), then 4 x 4 transposes.
  const int64_t in_word = col0 / 4 + lane;
  uint32_t v[kQuadsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kQuadsPerWarp; ++i) {
    const int64_t r = row0 + 4 * (warp + i * kWarps);
    const bool inside = r < rows && in_word < in_words;  // rows % 4 == 0: r + 3 < rows
    const uint32_t* p = src + r * in_words + in_word;
#pragma unroll
    for (int k = 0; k < 4; ++k) v[i][k] = inside ? p[k * in_words] : 0u;
  }
#pragma unroll
  for (int i = 0; i < kQuadsPerWarp; ++i) {
    const int q = warp + i * kWarps;  // word index in the tile's output rows
    // Bytes (little-endian): v[k] = input row k, columns 4 lane .. 4 lane + 3.
    const uint32_t lo01 = __byte_perm(v[i][0], v[i][1], 0x5140);  // r0c0 r1c0 r0c1 r1c1
    const uint32_t hi01 = __byte_perm(v[i][0], v[i][1], 0x7362);  // r0c2 r1c2 r0c3 r1c3
    const uint32_t lo23 = __byte_perm(v[i][2], v[i][3], 0x5140);
    const uint32_t hi23 = __byte_perm(v[i][2], v[i][3], 0x7362);
    const uint32_t column[4] = {__byte_perm(lo01, lo23, 0x5410),   // column 0: r0..r3
                                __byte_perm(lo01, lo23, 0x7632),   // column 1
                                __byte_perm(hi01, hi23, 0x5410),   // column 2
                                __byte_perm(hi01, hi23, 0x7632)};  // column 3
#pragma unroll
    for (int j = 0; j < 4; ++j) tile[4 * lane + j][q ^ lane] = column[j];
  }
  __syncthreads();

  // Phase 2: a warp writes one output row (128 bytes) per step.
  const int64_t out_word = row0 / 4 + lane;
#pragma unroll 4
  for (int o = warp; o < kTileBytes; o += kWarps) {
    const int64_t out_row = col0 + o;
    if (out_row < cols && out_word < out_words) {
      dst[out_row * out_words + out_word] = tile[o][lane ^ ((o / 4) % 32)];
    }
  }
}

}  // namespace

bool TransposeBytesSupports(int64_t batch, int64_t rows, int64_t cols) {
  return batch >= 1 && rows >= 1 && cols >= 1 && rows % 4 == 0 && cols % 4 == 0 &&
         batch <= kMaxGridYZ && (rows + kTileBytes - 1) / kTileBytes <= kMaxGridYZ &&
         (cols + kTileBytes - 1) / kTileBytes <= INT32_MAX;
}

cudaError_t LaunchTransposeBytes(cudaStream_t stream, const void* in, void* out,
                                 int64_t batch, int64_t rows, int64_t cols) {
  if (!TransposeBytesSupports(batch, rows, cols)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((cols + kTileBytes - 1) / kTileBytes),
                  static_cast<unsigned>((rows + kTileBytes - 1) / kTileBytes),
                  static_cast<unsigned>(batch));
  TransposeBytesKernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint32_t*>(in),
                                                      static_cast<uint32_t*>(out), rows, cols);
  return cudaGetLastError();
}

}  // namespace jax_fp8
