// XLA FFI handler "jax_fp8_block_gemm" (see block_gemm_cuda.h).
//
// cuBLASLt is column-major; the row-major out [M, N] = a [M, K] . b [N, K]^T is its
// D (N x M) = op(A) . B with A = b (stored K x N, transa = T), B = a (stored K x M,
// transb = N): Hopper's FP8 GEMMs take only this "TN" form. A's scales are b's, B's are a's.
//
// Per (device, shape, types, block modes, pointer alignments) a plan (matmul descriptor,
// layouts, the heuristic's algorithm) is made on first use and kept, in XLA's initialize
// stage (before any execution or command-buffer capture) when XLA runs it; executions
// only set the two scale pointers and enqueue cublasLtMatmul (no allocation, no sync).
// A plan's mutex covers those two steps, as the descriptor holds the pointers. Where the
// heuristic finds no algorithm, the plan says so and the plain kernel of
// block_gemm_fallback.cu runs instead. The workspace is a result buffer XLA allocates.
#include "block_gemm_cuda.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace jax_fp8 {
namespace ffi = xla::ffi;
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
constexpr int32_t kCompute32F = 68;                                    // CUBLAS_COMPUTE_32F
constexpr int32_t kR32F = 0, kR16BF = 14, kR8FE4M3 = 28, kR8FE5M2 = 29;  // cudaDataType_t
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

struct Plan {
  std::mutex mu;
  bool fallback = true;
  LtDesc desc = nullptr;
  LtLayout a_layout = nullptr, b_layout = nullptr, d_layout = nullptr;
  LtAlgo algo{};
};

// (device, m, n, k, a type, b type, out type, a tile, b tile, alignments a, b, out, sa, sb)
using PlanKey = std::tuple<int32_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t, bool,
                           bool, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t>;
std::mutex g_plans_mu;
std::map<PlanKey, std::unique_ptr<Plan>> g_plans;
std::map<int32_t, LtHandle> g_handles;

uint32_t Alignment(const void* p, int64_t batch_stride_bytes, int64_t batch) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) v |= static_cast<uintptr_t>(batch_stride_bytes);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

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

struct Gemm {  // one call's GEMM, as cuBLASLt sees it
  int64_t m, n, k;        // row-major out [m, n] = a [m, k] . b [n, k]^T
  int32_t a_type, b_type, out_type;
  bool a_tile, b_tile;
  const void *a, *b, *a_scale, *b_scale;
  void* out;
  size_t workspace_bytes;
};

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

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_fp8_block_gemm: " + msg);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp4(int64_t a) { return (a + 3) / 4 * 4; }

// Expected scale dims (after the leading axes) of an operand [rows, k] and the padded
// minor extent of that array.
std::pair<std::vector<int64_t>, int64_t> ScaleDims(int64_t rows, int64_t k, bool tile) {
  if (tile) return {{CeilDiv(rows, 128), RoundUp4(CeilDiv(k, 128))}, RoundUp4(CeilDiv(k, 128))};
  return {{CeilDiv(k, 128), RoundUp4(rows)}, RoundUp4(rows)};
}

bool DimsEqual(ffi::Span<const int64_t> dims, const std::vector<int64_t>& lead,
               const std::vector<int64_t>& tail) {
  if (dims.size() != lead.size() + tail.size()) return false;
  for (size_t i = 0; i < lead.size(); ++i) {
    if (dims[i] != lead[i]) return false;
  }
  for (size_t i = 0; i < tail.size(); ++i) {
    if (dims[lead.size() + i] != tail[i]) return false;
  }
  return true;
}

// One call, decoded and checked.
struct Call {
  Gemm g;
  int64_t batch, sa_size, sb_size, sa_ld, sb_ld;
  size_t out_bytes;
  uint32_t align[5];
};

ffi::ErrorOr<Call> Decode(ffi::AnyBuffer a, ffi::AnyBuffer a_scale, ffi::AnyBuffer b,
                          ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer>& out,
                          ffi::Result<ffi::AnyBuffer>& workspace, int32_t a_block_rows,
                          int32_t b_block_rows) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  const size_t rank = ad.size();
  if (rank < 2 || bd.size() != rank) {
    return ffi::Unexpected(Invalid("a and b must have the same rank >= 2"));
  }
  const std::vector<int64_t> lead(ad.begin(), ad.end() - 2);
  const int64_t m = ad[rank - 2], k = ad[rank - 1], n = bd[rank - 2];
  if (!DimsEqual(bd, lead, {n, k}) || !DimsEqual(out->dimensions(), lead, {m, n})) {
    return ffi::Unexpected(Invalid("need a [..., M, K], b [..., N, K] and out [..., M, N]"));
  }
  auto fp8 = [](ffi::DataType t) {
    return t == ffi::DataType::F8E4M3FN ? kR8FE4M3 : (t == ffi::DataType::F8E5M2 ? kR8FE5M2 : -1);
  };
  const ffi::DataType ot = out->element_type();
  Call c{};
  c.g = Gemm{m, n, k, fp8(a.element_type()), fp8(b.element_type()),
             ot == ffi::DataType::BF16 ? kR16BF : kR32F, a_block_rows == 128,
             b_block_rows == 128, a.untyped_data(), b.untyped_data(), a_scale.untyped_data(),
             b_scale.untyped_data(), out->untyped_data(), workspace->size_bytes()};
  if (c.g.a_type < 0 || c.g.b_type < 0) {
    return ffi::Unexpected(Invalid("a and b must be f8e4m3fn or f8e5m2"));
  }
  if (ot != ffi::DataType::BF16 && ot != ffi::DataType::F32) {
    return ffi::Unexpected(Invalid("out must be bf16 or f32"));
  }
  if ((a_block_rows != 1 && a_block_rows != 128) || (b_block_rows != 1 && b_block_rows != 128)) {
    return ffi::Unexpected(Invalid("block rows must be 1 or 128"));
  }
  const auto sa = ScaleDims(m, k, c.g.a_tile);
  const auto sb = ScaleDims(n, k, c.g.b_tile);
  if (a_scale.element_type() != ffi::DataType::F32 || b_scale.element_type() != ffi::DataType::F32 ||
      !DimsEqual(a_scale.dimensions(), lead, sa.first) ||
      !DimsEqual(b_scale.dimensions(), lead, sb.first)) {
    return ffi::Unexpected(
        Invalid("scales must be float32 in cuBLASLt's layout (see block_gemm_cuda.h)"));
  }
  c.batch = 1;
  for (int64_t d : lead) c.batch *= d;
  c.sa_size = sa.first[0] * sa.first[1];
  c.sb_size = sb.first[0] * sb.first[1];
  c.sa_ld = sa.second;
  c.sb_ld = sb.second;
  c.out_bytes = ffi::ByteWidth(ot);
  c.align[0] = Alignment(c.g.a, m * k, c.batch);
  c.align[1] = Alignment(c.g.b, n * k, c.batch);
  c.align[2] = Alignment(c.g.out, m * n * static_cast<int64_t>(c.out_bytes), c.batch);
  c.align[3] = Alignment(c.g.a_scale, c.sa_size * 4, c.batch);
  c.align[4] = Alignment(c.g.b_scale, c.sb_size * 4, c.batch);
  return c;
}

bool Empty(const Call& c) { return c.batch == 0 || c.g.m == 0 || c.g.n == 0 || c.g.k == 0; }

// The cached plan for this call (made now if new), or null without cuBLASLt.
Plan* FindPlan(const Call& c, int32_t device) {
  std::lock_guard<std::mutex> lt_lock(g_lt_mu);
  if (g_lt_version == 0) return nullptr;
  const PlanKey key{device,      c.g.m,       c.g.n,       c.g.k,      c.g.a_type,
                    c.g.b_type,  c.g.out_type, c.g.a_tile, c.g.b_tile, c.align[0],
                    c.align[1],  c.align[2],  c.align[3],  c.align[4]};
  std::lock_guard<std::mutex> lock(g_plans_mu);
  std::unique_ptr<Plan>& slot = g_plans[key];
  if (!slot) {
    slot = std::make_unique<Plan>();
    MakePlan(*slot, HandleFor(device), c.g, c.align);
  }
  return slot.get();
}

// Initialize stage (before any execution or command-buffer capture): makes the cuBLASLt
// handle and the plan, so that the execute stage only enqueues work.
ffi::Error BlockGemmInitialize(cudaStream_t, int32_t device, ffi::AnyBuffer a,
                               ffi::AnyBuffer a_scale, ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int32_t a_block_rows,
                               int32_t b_block_rows, bool force_fallback) {
  auto call = Decode(a, a_scale, b, b_scale, out, workspace, a_block_rows, b_block_rows);
  if (!call.has_value()) return call.error();
  if (!force_fallback && !Empty(*call)) FindPlan(*call, device);
  return ffi::Error::Success();
}

ffi::Error BlockGemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                            ffi::AnyBuffer a_scale, ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                            int32_t a_block_rows, int32_t b_block_rows, bool force_fallback) {
  auto decoded = Decode(a, a_scale, b, b_scale, out, workspace, a_block_rows, b_block_rows);
  if (!decoded.has_value()) return decoded.error();
  const Call& c = *decoded;
  const Gemm& g = c.g;
  if (c.batch == 0 || g.m == 0 || g.n == 0) return ffi::Error::Success();
  if (g.k == 0) {
    const cudaError_t err =
        cudaMemsetAsync(g.out, 0, c.batch * g.m * g.n * c.out_bytes, stream);
    return err == cudaSuccess ? ffi::Error::Success()
                              : ffi::Error::Internal(cudaGetErrorString(err));
  }
  const uint8_t* pa = static_cast<const uint8_t*>(g.a);
  const uint8_t* pb = static_cast<const uint8_t*>(g.b);
  const float* psa = static_cast<const float*>(g.a_scale);
  const float* psb = static_cast<const float*>(g.b_scale);
  uint8_t* po = static_cast<uint8_t*>(g.out);
  Plan* plan = force_fallback ? nullptr : FindPlan(c, device);
  if (plan && !plan->fallback) {
    LtHandle handle;
    {
      std::lock_guard<std::mutex> lock(g_plans_mu);
      handle = g_handles[device];
    }
    const float one = 1.0f, zero = 0.0f;
    std::lock_guard<std::mutex> lock(plan->mu);
    for (int64_t i = 0; i < c.batch; ++i) {
      const float* sa_i = psa + i * c.sa_size;
      const float* sb_i = psb + i * c.sb_size;
      void* o_i = po + i * g.m * g.n * c.out_bytes;
      LtStatus st = g_lt.desc_set(plan->desc, kDescAScalePointer, &sb_i, sizeof(void*));
      if (st == kLtSuccess) st = g_lt.desc_set(plan->desc, kDescBScalePointer, &sa_i, sizeof(void*));
      if (st == kLtSuccess) {
        st = g_lt.matmul(handle, plan->desc, &one, pb + i * g.n * g.k, plan->a_layout,
                         pa + i * g.m * g.k, plan->b_layout, &zero, o_i, plan->d_layout, o_i,
                         plan->d_layout, &plan->algo, workspace->untyped_data(),
                         workspace->size_bytes(), stream);
      }
      if (st != kLtSuccess) {
        return ffi::Error::Internal("jax_fp8_block_gemm: cublasLtMatmul failed with status " +
                                    std::to_string(st));
      }
    }
    return ffi::Error::Success();
  }
  for (int64_t i = 0; i < c.batch; ++i) {
    const BlockGemmArgs args{pa + i * g.m * g.k, psa + i * c.sa_size, g.a_type == kR8FE5M2,
                             g.a_tile, c.sa_ld, pb + i * g.n * g.k, psb + i * c.sb_size,
                             g.b_type == kR8FE5M2, g.b_tile, c.sb_ld,
                             po + i * g.m * g.n * c.out_bytes, g.out_type == kR16BF,
                             g.m, g.n, g.k};
    const cudaError_t err = LaunchBlockGemmFallback(stream, args);
    if (err != cudaSuccess) {
      return ffi::Error::Internal(std::string("jax_fp8_block_gemm: fallback kernel launch failed: ") +
                                  cudaGetErrorString(err));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

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

#define JAX_FP8_BLOCK_GEMM_BINDING(stage)                 \
  ffi::Ffi::Bind<stage>()                                 \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()           \
      .Ctx<ffi::DeviceOrdinal>()                          \
      .Arg<ffi::AnyBuffer>()                              \
      .Arg<ffi::AnyBuffer>()                              \
      .Arg<ffi::AnyBuffer>()                              \
      .Arg<ffi::AnyBuffer>()                              \
      .Ret<ffi::AnyBuffer>()                              \
      .Ret<ffi::AnyBuffer>()                              \
      .Attr<int32_t>("a_block_rows")                      \
      .Attr<int32_t>("b_block_rows")                      \
      .Attr<bool>("force_fallback")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8BlockGemmInitializeCuda, BlockGemmInitialize,
                              JAX_FP8_BLOCK_GEMM_BINDING(ffi::ExecutionStage::kInitialize));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8BlockGemmCuda, BlockGemmExecute,
                              JAX_FP8_BLOCK_GEMM_BINDING(ffi::ExecutionStage::kExecute),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
