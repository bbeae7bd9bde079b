// cuBLASLt loading and the plan cache of the block-scaled FP8 GEMM (block_gemm_cublaslt.h).
//
// A plan is made in XLA's initialize stage (before any execution or command-buffer
// capture) when XLA runs it, else at the first execution; executions only set the two
// scale pointers and enqueue cublasLtMatmul (no allocation, no sync). A plan's mutex
// covers those two steps, as the descriptor holds the pointers.
#include "block_gemm_cublaslt.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

namespace jax_fp8 {
namespace {

// The cuBLASLt ABI used here (cublasLt.h, cublas_api.h, library_types.h of cuBLAS 12.9+).
using LtStatus = int;
using LtHandle = void*;
using LtDesc = void*;
using LtLayout = void*;
using LtPref = void*;
struct LtAlgo {
  uint64_t data[8];
};
struct LtHeuristic {
  LtAlgo algo;
  size_t workspace_size;
  LtStatus state;
  float waves_count;
  int reserved[4];
};
constexpr LtStatus kLtSuccess = 0;
constexpr int32_t kCompute32F = 68;  // CUBLAS_COMPUTE_32F
constexpr int32_t kOpN = 0, kOpT = 1;
constexpr int32_t kDescTransA = 3, kDescTransB = 4, kDescAScalePointer = 17,
                  kDescBScalePointer = 18, kDescAScaleMode = 31, kDescBScaleMode = 32;
constexpr int32_t kPrefMaxWorkspace = 1, kPrefAlignA = 5, kPrefAlignB = 6, kPrefAlignC = 7,
                  kPrefAlignD = 8;
constexpr int32_t kScaleVec128 = 4, kScaleBlk128x128 = 5;  // cublasLtMatmulMatrixScale_t

struct LtApi {
  LtStatus (*create)(LtHandle*);
  size_t (*get_version)();
  LtStatus (*desc_create)(LtDesc*, int32_t, int32_t);
  LtStatus (*desc_destroy)(LtDesc);
  LtStatus (*desc_set)(LtDesc, int32_t, const void*, size_t);
  LtStatus (*layout_create)(LtLayout*, int32_t, uint64_t, uint64_t, int64_t);
  LtStatus (*layout_destroy)(LtLayout);
  LtStatus (*pref_create)(LtPref*);
  LtStatus (*pref_destroy)(LtPref);
  LtStatus (*pref_set)(LtPref, int32_t, const void*, size_t);
  LtStatus (*heuristic)(LtHandle, LtDesc, LtLayout, LtLayout, LtLayout, LtLayout, LtPref, int,
                        LtHeuristic*, int*);
  LtStatus (*matmul)(LtHandle, LtDesc, const void*, const void*, LtLayout, const void*, LtLayout,
                     const void*, const void*, LtLayout, void*, LtLayout, const LtAlgo*, void*,
                     size_t, cudaStream_t);
};

std::mutex g_lt_mu;
LtApi g_lt{};
size_t g_lt_version = 0;  // nonzero once loaded

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!*fn) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *fn != nullptr;
}

}  // namespace

struct Plan {
  std::mutex mu;
  bool fallback = true;
  LtDesc desc = nullptr;
  LtLayout a_layout = nullptr, b_layout = nullptr, d_layout = nullptr;
  LtAlgo algo{};
};

namespace {

// (device, m, n, k, a type, b type, out type, a tile, b tile, alignments a, b, out, sa, sb)
using PlanKey = std::tuple<int32_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t, bool,
                           bool, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>;
std::mutex g_plans_mu;
std::map<PlanKey, std::unique_ptr<Plan>> g_plans;
std::map<int32_t, LtHandle> g_handles;

LtHandle HandleFor(int32_t device) {  // g_plans_mu held
  auto it = g_handles.find(device);
  if (it != g_handles.end()) return it->second;
  int current = -1;
  cudaGetDevice(&current);
  if (current != device) cudaSetDevice(device);
  LtHandle h = nullptr;
  if (g_lt.create(&h) != kLtSuccess) h = nullptr;
  if (current != device && current >= 0) cudaSetDevice(current);
  g_handles[device] = h;
  return h;
}

// Makes the plan: descriptor, layouts and the best algorithm, or marks it as a fallback.
void MakePlan(Plan& plan, LtHandle handle, const Gemm& g, const uint32_t (&align)[5]) {
  if (!handle) return;
  LtDesc desc = nullptr;
  if (g_lt.desc_create(&desc, kCompute32F, kR32F) != kLtSuccess) return;
  const int32_t ta = kOpT, tb = kOpN;
  const int32_t mode_a = g.b_tile ? kScaleBlk128x128 : kScaleVec128;  // cuBLAS A is b
  const int32_t mode_b = g.a_tile ? kScaleBlk128x128 : kScaleVec128;
  bool ok = g_lt.desc_set(desc, kDescTransA, &ta, sizeof(ta)) == kLtSuccess &&
            g_lt.desc_set(desc, kDescTransB, &tb, sizeof(tb)) == kLtSuccess &&
            g_lt.desc_set(desc, kDescAScaleMode, &mode_a, sizeof(mode_a)) == kLtSuccess &&
            g_lt.desc_set(desc, kDescBScaleMode, &mode_b, sizeof(mode_b)) == kLtSuccess &&
            g_lt.desc_set(desc, kDescAScalePointer, &g.b_scale, sizeof(void*)) == kLtSuccess &&
            g_lt.desc_set(desc, kDescBScalePointer, &g.a_scale, sizeof(void*)) == kLtSuccess;
  LtLayout la = nullptr, lb = nullptr, ld = nullptr;
  ok = ok && g_lt.layout_create(&la, g.b_type, g.k, g.n, g.k) == kLtSuccess &&
       g_lt.layout_create(&lb, g.a_type, g.k, g.m, g.k) == kLtSuccess &&
       g_lt.layout_create(&ld, g.out_type, g.n, g.m, g.n) == kLtSuccess;
  LtPref pref = nullptr;
  int found = 0;
  LtHeuristic result{};
  if (ok && g_lt.pref_create(&pref) == kLtSuccess) {
    const uint64_t ws = g.workspace_bytes;
    ok = g_lt.pref_set(pref, kPrefMaxWorkspace, &ws, sizeof(ws)) == kLtSuccess &&
         g_lt.pref_set(pref, kPrefAlignA, &align[1], sizeof(uint32_t)) == kLtSuccess &&
         g_lt.pref_set(pref, kPrefAlignB, &align[0], sizeof(uint32_t)) == kLtSuccess &&
         g_lt.pref_set(pref, kPrefAlignC, &align[2], sizeof(uint32_t)) == kLtSuccess &&
         g_lt.pref_set(pref, kPrefAlignD, &align[2], sizeof(uint32_t)) == kLtSuccess &&
         g_lt.heuristic(handle, desc, la, lb, ld, ld, pref, 1, &result, &found) == kLtSuccess;
    g_lt.pref_destroy(pref);
  }
  if (ok && found > 0 && result.state == kLtSuccess && result.workspace_size <= g.workspace_bytes) {
    plan.fallback = false;
    plan.desc = desc;
    plan.a_layout = la, plan.b_layout = lb, plan.d_layout = ld;
    plan.algo = result.algo;
    return;
  }
  if (la) g_lt.layout_destroy(la);
  if (lb) g_lt.layout_destroy(lb);
  if (ld) g_lt.layout_destroy(ld);
  if (desc) g_lt.desc_destroy(desc);
}

}  // namespace

uint32_t Alignment(const void* p, int64_t batch_stride_bytes, int64_t batch) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) v |= static_cast<uintptr_t>(batch_stride_bytes);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

Plan* FindPlan(const Gemm& g, const uint32_t (&align)[5], int32_t device) {
  std::lock_guard<std::mutex> lt_lock(g_lt_mu);
  if (g_lt_version == 0) return nullptr;
  const PlanKey key{device,   g.m,      g.n,      g.k,      g.a_type, g.b_type, g.out_type,
                    g.a_tile, g.b_tile, align[0], align[1], align[2], align[3], align[4]};
  std::lock_guard<std::mutex> lock(g_plans_mu);
  std::unique_ptr<Plan>& slot = g_plans[key];
  if (!slot) {
    slot = std::make_unique<Plan>();
    MakePlan(*slot, HandleFor(device), g, align);
  }
  return slot.get();
}

bool HasAlgorithm(const Plan& plan) { return !plan.fallback; }

int RunPlan(Plan& plan, int32_t device, const Gemm& g, const GemmBatch& batch, void* workspace,
            cudaStream_t stream) {
  LtHandle handle;
  {
    std::lock_guard<std::mutex> lock(g_plans_mu);
    handle = g_handles[device];
  }
  const uint8_t* pa = static_cast<const uint8_t*>(g.a);
  const uint8_t* pb = static_cast<const uint8_t*>(g.b);
  const float* psa = static_cast<const float*>(g.a_scale);
  const float* psb = static_cast<const float*>(g.b_scale);
  uint8_t* po = static_cast<uint8_t*>(g.out);
  const float one = 1.0f, zero = 0.0f;
  std::lock_guard<std::mutex> lock(plan.mu);
  for (int64_t i = 0; i < batch.count; ++i) {
    const float* sa_i = psa + i * batch.a_scale_size;
    const float* sb_i = psb + i * batch.b_scale_size;
    void* o_i = po + i * g.m * g.n * batch.out_bytes;
    LtStatus st = g_lt.desc_set(plan.desc, kDescAScalePointer, &sb_i, sizeof(void*));
    if (st == kLtSuccess) st = g_lt.desc_set(plan.desc, kDescBScalePointer, &sa_i, sizeof(void*));
    if (st == kLtSuccess) {
      st = g_lt.matmul(handle, plan.desc, &one, pb + i * g.n * g.k, plan.a_layout,
                       pa + i * g.m * g.k, plan.b_layout, &zero, o_i, plan.d_layout, o_i,
                       plan.d_layout, &plan.algo, workspace, g.workspace_bytes, stream);
    }
    if (st != kLtSuccess) return st;
  }
  return kLtSuccess;
}

size_t LoadCublasLt(const std::string& path, std::string* error) {
  std::lock_guard<std::mutex> lock(g_lt_mu);
  if (g_lt_version != 0) return g_lt_version;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    *error = "cannot load " + path + ": " + (why ? why : "unknown error");
    return 0;
  }
  LtApi api{};
  std::string missing;
  Resolve(lib, "cublasLtCreate", &api.create, &missing);
  Resolve(lib, "cublasLtGetVersion", &api.get_version, &missing);
  Resolve(lib, "cublasLtMatmulDescCreate", &api.desc_create, &missing);
  Resolve(lib, "cublasLtMatmulDescDestroy", &api.desc_destroy, &missing);
  Resolve(lib, "cublasLtMatmulDescSetAttribute", &api.desc_set, &missing);
  Resolve(lib, "cublasLtMatrixLayoutCreate", &api.layout_create, &missing);
  Resolve(lib, "cublasLtMatrixLayoutDestroy", &api.layout_destroy, &missing);
  Resolve(lib, "cublasLtMatmulPreferenceCreate", &api.pref_create, &missing);
  Resolve(lib, "cublasLtMatmulPreferenceDestroy", &api.pref_destroy, &missing);
  Resolve(lib, "cublasLtMatmulPreferenceSetAttribute", &api.pref_set, &missing);
  Resolve(lib, "cublasLtMatmulAlgoGetHeuristic", &api.heuristic, &missing);
  Resolve(lib, "cublasLtMatmul", &api.matmul, &missing);
  if (!missing.empty()) {
    *error = path + " lacks " + missing;
    dlclose(lib);
    return 0;
  }
  g_lt = api;
  g_lt_version = api.get_version();  // the library stays loaded for the process's life
  if (g_lt_version == 0) *error = path + ": cublasLtGetVersion() returned 0";
  return g_lt_version;
}

}  // namespace jax_fp8
