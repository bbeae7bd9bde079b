// The runtime of host_cuda.h (barriers, warp reductions, shared memory, the grid loop) and
// a C entry point for ffi/block_quantize_cuda.cu's LaunchBlockQuantize, for ctypes.
#include "host_cuda.h"

#include <ucontext.h>

#include "block_quantize_cuda.h"

thread_local uint3 threadIdx, blockIdx;
thread_local dim3 gridDim, blockDim;
int host_nan_keeps_sign = 0;

// The threads of a CTA are fibers (ucontext) run by one OS thread: each runs until it
// reaches a synchronization point (or returns); when every thread has, the point is
// resolved: a warp's reduction once its 32 lanes are there, a CTA barrier once all
// threads are. Threads that wait at different kinds of points are a divergent barrier: the
// launch fails.
namespace {
enum State { kRunnable, kBarrier, kBarrierOr, kWarpMax, kDone };
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  State state;
  uint32_t value, result;
};
std::vector<Fiber> g_fibers;
ucontext_t g_main;
unsigned g_current;
void (*g_body)(void*);
void* g_ctx;
std::vector<unsigned char> g_smem(64 * 1024);
bool g_divergent;

uint32_t Wait(State s, uint32_t value) {
  Fiber& f = g_fibers[g_current];
  f.state = s, f.value = value;
  swapcontext(&f.ctx, &g_main);
  return g_fibers[g_current].result;
}

void Entry(unsigned t) {
  g_body(g_ctx);
  g_fibers[t].state = kDone;  // uc_link returns to g_main
}

// Runs one CTA of `threads` fibers; false on a divergent barrier.
bool RunCta(unsigned threads) {
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = g_fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &g_main;
    makecontext(&f.ctx, reinterpret_cast<void (*)()>(Entry), 1, t);
    f.state = kRunnable;
  }
  for (;;) {
    for (unsigned t = 0; t < threads; ++t) {
      if (g_fibers[t].state != kRunnable) continue;
      g_current = t;
      threadIdx = {t, 0, 0};
      swapcontext(&g_main, &g_fibers[t].ctx);
    }
    bool resolved = false;
    for (unsigned w = 0; w < threads / 32; ++w) {
      bool all = true;
      uint32_t m = 0;
      for (unsigned l = 0; l < 32; ++l) {
        const Fiber& f = g_fibers[32 * w + l];
        all = all && f.state == kWarpMax;
        m = m > f.value ? m : f.value;
      }
      if (!all) continue;
      for (unsigned l = 0; l < 32; ++l) g_fibers[32 * w + l].result = m, g_fibers[32 * w + l].state = kRunnable;
      resolved = true;
    }
    if (resolved) continue;
    const State s = g_fibers[0].state;
    uint32_t any = 0;
    for (unsigned t = 0; t < threads; ++t) {
      if (g_fibers[t].state != s) return false;
      any |= g_fibers[t].value != 0;
    }
    if (s == kDone) return true;
    if (s == kWarpMax) return false;
    for (unsigned t = 0; t < threads; ++t) g_fibers[t].result = any, g_fibers[t].state = kRunnable;
  }
}
}  // namespace

void host_syncthreads() { Wait(kBarrier, 0); }
int host_syncthreads_or(int pred) { return static_cast<int>(Wait(kBarrierOr, pred != 0)); }
uint32_t host_reduce_max(uint32_t v) { return Wait(kWarpMax, v); }  // all 32 lanes
void* host_shared(size_t n) { return n <= g_smem.size() ? g_smem.data() : nullptr; }

void host_run_grid(dim3 grid, unsigned threads, void (*body)(void*), void* ctx) {
  g_body = body, g_ctx = ctx;
  gridDim = grid, blockDim = dim3(threads);
  if (g_fibers.size() < threads) g_fibers.resize(threads);
  for (auto& f : g_fibers) f.stack.resize(256 * 1024);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::memset(g_smem.data(), 0xA5, g_smem.size());  // shared memory starts as garbage
        blockIdx = {x, y, z};
        if (!RunCta(threads)) g_divergent = true;
      }
}

extern "C" int host_block_quantize(int in_type, int fp8_type, const void* x, int64_t batch,
                                   int64_t rows, int64_t cols, int tile_2d, void* q, float* s,
                                   void* q_t, float* s_t, float eps, int pow2, int gemm,
                                   int nan_keeps_sign) {
  host_nan_keeps_sign = nan_keeps_sign;
  jax_fp8::BlockQuantizeArgs a{};
  a.in_type = static_cast<jax_fp8::InType>(in_type);
  a.fp8_type = static_cast<jax_fp8::Fp8Type>(fp8_type);
  a.x = x;
  a.batch = batch, a.rows = rows, a.cols = cols, a.tile_2d = tile_2d;
  a.q = q, a.scale_inv = s, a.q_t = q_t, a.scale_inv_t = s_t;
  a.amax_epsilon = eps, a.power_of_2_scale = pow2, a.gemm_layout = gemm;
  g_divergent = false;
  const int rc = jax_fp8::LaunchBlockQuantize(nullptr, a);
  return rc ? rc : (g_divergent ? -1 : 0);
}
