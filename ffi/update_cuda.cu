// CUDA kernel of the fused update: one thread block per tensor, every tensor of
// every group in one launch.
//
// All groups of a launch are described in the kernel's parameters (no device
// memory for descriptors, so nothing to allocate or copy and the launch can be
// captured in a CUDA graph). To fit ~1,020 groups into the 32 KB parameter space,
// each buffer is a 32-bit element offset from one base pointer, and the
// per-group scaled fp8 max is an index into a 16-entry table. Where the call's
// buffers span more than 2^32 floats (16 GB: a large model's state next to amaxes
// XLA placed in its temporary buffer), the offsets are 64-bit and a launch takes
// ~580 groups. In place the output offsets equal the input ones. A new chunk (one more launch)
// starts only when a limit is hit: group count, more than 16 distinct scaled maxima, or 2^31
// blocks.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "update_cuda.h"

namespace jax_fp8 {
namespace {

// 128 threads x 8 values cover a 1024-long history in one pass, and 16 such blocks
// fit on an SM.
constexpr int kMaxThreads = 128;
constexpr int kValuesPerThread = 8;  // history values each thread holds per pass
constexpr int kMaxScaledMax = 16;
constexpr uint32_t kLenBits = 28;  // len_fmt = len << 4 | scaled_max index

template <int K, typename Off>
struct LaunchParams {
  float* base;
  UpdateOptions opt;
  uint32_t num_groups;
  uint32_t has_amax;
  float scaled_max[kMaxScaledMax];
  uint32_t block_start[K + 1];  // first block of each group; [num_groups] = total
  Off history[K], scale[K], scale_inv[K], amax[K];  // offsets from base, in floats
  Off history_out[K], scale_out[K];                 // the results' (= history, scale in place)
  uint32_t len_fmt[K];
};
static_assert(sizeof(LaunchParams<kMaxGroupsPerLaunch, uint32_t>) <= 32764,
              "kernel parameters exceed CUDA's 32,764-byte limit");
// With 64-bit offsets (buffers more than 16 GB apart) a group takes 56 bytes.
constexpr int kMaxGroupsPerWideLaunch = 580;
static_assert(sizeof(LaunchParams<kMaxGroupsPerWideLaunch, uint64_t>) <= 32764,
              "kernel parameters exceed CUDA's 32,764-byte limit");
constexpr int kSmallLaunch = 32;  // a smaller parameter block for calls with few groups

__device__ __forceinline__ float BlockMax(float v, float* warp_max) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmax_num(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  const int warp = threadIdx.x / 32;
  if ((threadIdx.x & 31) == 0) warp_max[warp] = v;
  __syncthreads();
  float r = warp_max[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) r = fmax_num(r, warp_max[w]);
  return r;
}

// The group of block b: block_start[g] <= b < block_start[g + 1]. Since every group
// has at least one block, g <= b; when all groups before b are single tensors (a
// per-tensor pytree) g == b, found with two reads instead of a binary search.
template <int K, typename Off>
__device__ __forceinline__ int FindGroup(const LaunchParams<K, Off>& p, uint32_t b) {
  int hi = min(static_cast<int>(b), static_cast<int>(p.num_groups) - 1);
  if (p.block_start[hi] <= b) return hi;
  int lo = 0;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.block_start[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <int K, typename Off>
__global__ void __launch_bounds__(kMaxThreads)
    UpdateKernel(const __grid_constant__ LaunchParams<K, Off> p) {
  __shared__ float warp_max[kMaxThreads / 32];
  const int g = FindGroup(p, blockIdx.x);
  const int64_t t = blockIdx.x - p.block_start[g];
  const int64_t len = p.len_fmt[g] >> 4;
  const float* hist = p.base + p.history[g] + t * len;
  float* hist_out = p.base + p.history_out[g] + t * len;
  const float* scale = p.base + p.scale[g] + t;
  float* scale_out = p.base + p.scale_out[g] + t;
  float* scale_inv = p.base + p.scale_inv[g] + t;
  const float* amax = p.has_amax ? p.base + p.amax[g] + t : nullptr;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kValuesPerThread;

  // Issue every load the first pass needs at once (history values, the staging
  // slot, amax, the previous scale), so the block waits for one memory round trip.
  float v[kValuesPerThread];
#pragma unroll
  for (int k = 0; k < kValuesPerThread; ++k) {
    const int64_t j = 1 + k * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    v[k] = j < len ? hist[j] : 0.0f;  // 0 is neutral: the max starts from 0
  }
  const float prev_scale = threadIdx.x == 0 ? *scale : 0.0f;
  // Every thread reads the staging slot before any thread writes slot 0.
  const float h0 = merge_amax(hist[0], amax);
  if (is_unused(h0, p.opt)) {  // uniform across the block
    if (hist_out != hist) {    // out of place: the history is copied unchanged
      for (int64_t j = threadIdx.x; j < len; j += blockDim.x) hist_out[j] = hist[j];
    }
    if (threadIdx.x == 0) {
      *scale_out = prev_scale;
      *scale_inv = scale_inverse(prev_scale);
    }
    return;
  }
  // Roll, one pass of `step` values at a time: old[j] for the pass is in registers, a
  // barrier, then each goes to j - 1. In place, a pass only writes below its own
  // reads, and the next pass's writes wait at its barrier for every read of this one,
  // so no value is overwritten before it is read (out of place nothing can be).
  float rest = 0.0f;
  for (int64_t c0 = 1;;) {
#pragma unroll
    for (int k = 0; k < kValuesPerThread; ++k) rest = fmax_num(rest, v[k]);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kValuesPerThread; ++k) {
      const int64_t j = c0 + k * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (j < len) hist_out[j - 1] = (j == 1) ? 0.0f : v[k];
    }
    c0 += step;
    if (c0 >= len) break;
#pragma unroll
    for (int k = 0; k < kValuesPerThread; ++k) {
      const int64_t j = c0 + k * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      v[k] = j < len ? hist[j] : 0.0f;
    }
  }
  rest = BlockMax(rest, warp_max);
  if (threadIdx.x == 0) {
    hist_out[len - 1] = last_slot_value(h0, len);
    const float s = new_scale(reduced_amax(h0, rest, p.opt), prev_scale,
                              p.scaled_max[p.len_fmt[g] & 15u], p.opt);
    *scale_out = s;
    *scale_inv = scale_inverse(s);
  }
}

// Lowest and highest address of a group's buffers.
void GroupSpan(const TensorGroup& g, uintptr_t* lo, uintptr_t* hi) {
  for (const void* ptr :
       {static_cast<const void*>(g.history), static_cast<const void*>(g.scale),
        static_cast<const void*>(g.scale_inv), static_cast<const void*>(g.amax),
        static_cast<const void*>(g.HistoryOut()), static_cast<const void*>(g.ScaleOut())}) {
    if (ptr == nullptr) continue;
    *lo = std::min(*lo, reinterpret_cast<uintptr_t>(ptr));
    *hi = std::max(*hi, reinterpret_cast<uintptr_t>(ptr));
  }
}

template <typename Off>
bool SpanFits(uintptr_t lo, uintptr_t hi) {
  return (hi - lo) / sizeof(float) <= std::numeric_limits<Off>::max();
}

// Fills `p` with groups [first, ...) until a limit is hit; returns one past the last
// group taken. Groups with no tensors are skipped.
template <int K, typename Off>
size_t FillParams(const TensorGroup* groups, size_t first, size_t n, const UpdateOptions& opt,
                  LaunchParams<K, Off>* p, int64_t* max_len) {
  uintptr_t lo = std::numeric_limits<uintptr_t>::max(), hi = 0;
  int num_sm = 0, g_in = 0;
  uint64_t blocks = 0;
  size_t i = first;
  for (; i < n && g_in < K; ++i) {
    const TensorGroup& g = groups[i];
    if (g.count == 0) continue;
    uintptr_t nlo = lo, nhi = hi;
    GroupSpan(g, &nlo, &nhi);
    int sm = 0;
    while (sm < num_sm && p->scaled_max[sm] != g.scaled_max) ++sm;
    // (The offset width was chosen for the whole call's span: NeedsWideOffsets.)
    if (g_in > 0 && (sm == kMaxScaledMax || blocks + g.count > INT32_MAX)) break;
    if (sm == num_sm) p->scaled_max[num_sm++] = g.scaled_max;
    lo = nlo;
    hi = nhi;
    p->block_start[g_in] = static_cast<uint32_t>(blocks);
    p->len_fmt[g_in] = static_cast<uint32_t>(g.len) << 4 | static_cast<uint32_t>(sm);
    blocks += static_cast<uint64_t>(g.count);
    *max_len = std::max(*max_len, g.len);
    ++g_in;
  }
  p->base = reinterpret_cast<float*>(lo);
  p->opt = opt;
  p->num_groups = static_cast<uint32_t>(g_in);
  p->block_start[g_in] = static_cast<uint32_t>(blocks);
  // Offsets need the final base, so take them in a second pass over the same groups.
  int k = 0;
  for (size_t j = first; j < i; ++j) {
    const TensorGroup& g = groups[j];
    if (g.count == 0) continue;
    auto off = [&](const void* ptr) {
      return ptr ? static_cast<Off>((reinterpret_cast<uintptr_t>(ptr) - lo) / sizeof(float))
                 : Off{0};
    };
    p->history[k] = off(g.history);
    p->scale[k] = off(g.scale);
    p->history_out[k] = off(g.HistoryOut());
    p->scale_out[k] = off(g.ScaleOut());
    p->scale_inv[k] = off(g.scale_inv);
    p->amax[k] = off(g.amax);
    ++k;
  }
  return i;
}

// One address span for the whole call decides the offset width: 32-bit offsets when
// every buffer lies within 2^32 floats of the lowest, else 64-bit ones. (Chunking by
// span instead split a call whose amaxes sit far from its states into one launch
// per group: 288 launches in a 24-block train step.)
bool NeedsWideOffsets(const TensorGroup* groups, size_t n) {
  uintptr_t lo = std::numeric_limits<uintptr_t>::max(), hi = 0;
  for (size_t i = 0; i < n; ++i) {
    if (groups[i].count > 0) GroupSpan(groups[i], &lo, &hi);
  }
  return hi > lo && !SpanFits<uint32_t>(lo, hi);
}

template <int K, typename Off>
cudaError_t LaunchChunk(cudaStream_t stream, const TensorGroup* groups, size_t* first, size_t n,
                        const UpdateOptions& opt, bool has_amax) {
  LaunchParams<K, Off> p;
  int64_t max_len = 1;
  *first = FillParams<K>(groups, *first, n, opt, &p, &max_len);
  p.has_amax = has_amax ? 1u : 0u;
  const uint32_t blocks = p.block_start[p.num_groups];
  if (blocks == 0) return cudaSuccess;
  const int64_t per_thread = (max_len + kValuesPerThread - 1) / kValuesPerThread;
  const int threads = static_cast<int>(
      std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (per_thread + 31) / 32 * 32)));
  UpdateKernel<K, Off><<<blocks, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchUpdate(cudaStream_t stream, const TensorGroup* groups, size_t num_groups,
                         const UpdateOptions& opt, const char** why) {
  bool has_amax = false;
  size_t nonempty = 0;
  for (size_t i = 0; i < num_groups; ++i) {
    if (groups[i].len >= (int64_t{1} << kLenBits) || groups[i].count > INT32_MAX) {
      *why = "a history longer than 2^28 or more than 2^31 tensors in one state";
      return cudaErrorInvalidValue;
    }
    has_amax = has_amax || groups[i].amax != nullptr;
    nonempty += groups[i].count > 0;
  }
  const bool wide = NeedsWideOffsets(groups, num_groups);
  size_t first = 0;
  while (first < num_groups) {
    cudaError_t err;
    if (groups[first].count == 0) {
      ++first;
      continue;
    } else if (wide) {
      err = nonempty <= kSmallLaunch ? LaunchChunk<kSmallLaunch, uint64_t>(
                                           stream, groups, &first, num_groups, opt, has_amax)
                                     : LaunchChunk<kMaxGroupsPerWideLaunch, uint64_t>(
                                           stream, groups, &first, num_groups, opt, has_amax);
    } else if (nonempty <= kSmallLaunch) {
      err = LaunchChunk<kSmallLaunch, uint32_t>(stream, groups, &first, num_groups, opt, has_amax);
    } else {
      err = LaunchChunk<kMaxGroupsPerLaunch, uint32_t>(stream, groups, &first, num_groups, opt,
                                                       has_amax);
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jax_fp8
