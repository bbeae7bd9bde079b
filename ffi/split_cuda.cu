// The split of a packed array into its pieces: one warp per piece, every piece of a
// launch described in the kernel's parameters (nothing to allocate or copy, so the
// launch can be captured in a CUDA graph).
//
// Why a kernel: a train step on a packed FP8 state needs each layer's scale_inv as a
// buffer of its own (cuBLASLt's FP8 GEMM takes its scales by pointer). As slices, XLA
// emits one tiny fusion per state -- hundreds of kernel launches per step, each of them
// also autotuned when the step compiles.
#include <cstdint>
#include <limits>

#include "split_cuda.h"

namespace jax_fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kPiecesPerBlock = kThreads / 32;

template <int K>
struct SplitParams {
  const float* src;
  uint32_t num_pieces;
  uint32_t pad;
  float* dst[K];
  uint32_t start[K];  // offset of the piece in src, in floats
  uint32_t count[K];
};
constexpr int kMaxPiecesPerLaunch = 2040;
static_assert(sizeof(SplitParams<kMaxPiecesPerLaunch>) <= 32764,
              "kernel parameters exceed CUDA's 32,764-byte limit");
constexpr int kSmallLaunch = 64;  // a smaller parameter block for calls with few pieces

template <int K>
__global__ void __launch_bounds__(kThreads)
    SplitRowsKernel(const __grid_constant__ SplitParams<K> p) {
  const uint32_t k = blockIdx.x * kPiecesPerBlock + threadIdx.x / 32;
  if (k >= p.num_pieces) return;
  const float* src = p.src + p.start[k];
  float* dst = p.dst[k];
  for (uint32_t j = threadIdx.x % 32; j < p.count[k]; j += 32) dst[j] = src[j];
}

// Describes pieces from *k on (skipping empty ones, which have no buffer to write) until
// K are described or none are left, launches, and advances *k and *offset past them.
template <int K>
cudaError_t LaunchSome(cudaStream_t stream, const float* src, float* const* dsts,
                       const int64_t* counts, size_t num_pieces, size_t* k, uint64_t* offset) {
  SplitParams<K> p{};
  p.src = src;
  uint32_t n = 0;
  for (; *k < num_pieces && n < K; ++*k) {
    const int64_t count = counts[*k];
    if (count > 0) {
      p.dst[n] = dsts[*k];
      p.start[n] = static_cast<uint32_t>(*offset);
      p.count[n] = static_cast<uint32_t>(count);
      ++n;
    }
    *offset += static_cast<uint64_t>(count);
  }
  if (n == 0) return cudaSuccess;
  p.num_pieces = n;
  const unsigned blocks = (n + kPiecesPerBlock - 1) / kPiecesPerBlock;
  SplitRowsKernel<K><<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchSplitRows(cudaStream_t stream, const float* src, float* const* dsts,
                            const int64_t* counts, size_t num_pieces, const char** why) {
  uint64_t total = 0;
  size_t nonempty = 0;
  for (size_t k = 0; k < num_pieces; ++k) {
    if (counts[k] < 0) {
      *why = "negative piece size";
      return cudaErrorInvalidValue;
    }
    total += static_cast<uint64_t>(counts[k]);
    nonempty += counts[k] > 0;
  }
  if (total > std::numeric_limits<uint32_t>::max()) {  // the starts are 32-bit
    *why = "the pieces must hold fewer than 2^32 floats in all";
    return cudaErrorInvalidValue;
  }
  size_t k = 0;
  uint64_t offset = 0;
  if (nonempty <= kSmallLaunch) {
    return LaunchSome<kSmallLaunch>(stream, src, dsts, counts, num_pieces, &k, &offset);
  }
  while (k < num_pieces) {
    const cudaError_t err =
        LaunchSome<kMaxPiecesPerLaunch>(stream, src, dsts, counts, num_pieces, &k, &offset);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jax_fp8
