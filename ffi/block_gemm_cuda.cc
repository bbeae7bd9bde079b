// XLA FFI handler "jax_fp8_block_gemm" (see block_gemm_cuda.h): decodes and checks the
// call, then runs the CUTLASS configuration the measured table picks for it
// (block_gemm_cutlass.cc), else cuBLASLt's plan (block_gemm_cublaslt.cc), else, where
// cuBLASLt has no algorithm, the plain kernel of block_gemm_fallback.cu. The `kernel`
// attribute can name one of them instead (kKernel* below). The workspace is a result
// buffer XLA allocates.
#include "block_gemm_cuda.h"

#include <string>
#include <vector>

#include "block_gemm_cublaslt.h"
#include "block_gemm_cutlass.h"
#include "block_scale_layout.h"
#include "cuda_handler_util.h"
#include "cutlass_handler.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

constexpr const char* kName = "jax_fp8_block_gemm";

// The `kernel` attribute: the table's choice, cuBLASLt (else the plain kernel), the plain
// kernel, or CUTLASS configuration i as kKernelCutlass + i.
constexpr int32_t kKernelAuto = 0, kKernelCublasLt = 1, kKernelFallback = 2, kKernelCutlass = 100;

ffi::Error Invalid(const std::string& msg) { return InvalidArgument(kName, msg); }

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
  GemmBatch batch;
  int64_t sa_ld, sb_ld;
  uint32_t align[5];
  CutlassGemm cg;
  bool e4m3;  // both operands E4M3
};

// The CUTLASS configuration this call runs, or -1; an error for a `kernel` attribute
// naming a configuration that is not compiled or does not compute this GEMM.
ffi::ErrorOr<int> CutlassChoice(const Call& c, int32_t kernel) {
  if (kernel == kKernelAuto) return CutlassPick(c.cg, c.e4m3, c.align);
  if (kernel < kKernelCutlass) return -1;
  const int i = kernel - kKernelCutlass;
  if (i >= CutlassConfigCount()) {
    return ffi::Unexpected(Invalid("kernel names no compiled CUTLASS configuration"));
  }
  if (!CutlassTakes(i, c.cg, c.e4m3, c.align)) {
    return ffi::Unexpected(Invalid(std::string("CUTLASS configuration ") + CutlassConfigAt(i).name +
                                   " does not take this GEMM"));
  }
  return i;
}

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
  c.g = Gemm{m,
             n,
             k,
             fp8(a.element_type()),
             fp8(b.element_type()),
             ot == ffi::DataType::BF16 ? kR16BF : kR32F,
             a_block_rows == 128,
             b_block_rows == 128,
             a.untyped_data(),
             b.untyped_data(),
             a_scale.untyped_data(),
             b_scale.untyped_data(),
             out->untyped_data(),
             workspace->size_bytes()};
  if (c.g.a_type < 0 || c.g.b_type < 0) {
    return ffi::Unexpected(Invalid("a and b must be f8e4m3fn or f8e5m2"));
  }
  if (ot != ffi::DataType::BF16 && ot != ffi::DataType::F32) {
    return ffi::Unexpected(Invalid("out must be bf16 or f32"));
  }
  if ((a_block_rows != 1 && a_block_rows != 128) || (b_block_rows != 1 && b_block_rows != 128)) {
    return ffi::Unexpected(Invalid("block rows must be 1 or 128"));
  }
  const GemmScaleDims sa = GemmScaleLayout(m, k, c.g.a_tile);
  const GemmScaleDims sb = GemmScaleLayout(n, k, c.g.b_tile);
  if (a_scale.element_type() != ffi::DataType::F32 ||
      b_scale.element_type() != ffi::DataType::F32 ||
      !DimsEqual(a_scale.dimensions(), lead, {sa.outer, sa.ld}) ||
      !DimsEqual(b_scale.dimensions(), lead, {sb.outer, sb.ld})) {
    return ffi::Unexpected(
        Invalid("scales must be float32 in cuBLASLt's layout (see block_scale_layout.h)"));
  }
  int64_t batch = 1;
  for (int64_t d : lead) batch *= d;
  c.batch = GemmBatch{batch, sa.outer * sa.ld, sb.outer * sb.ld, ffi::ByteWidth(ot)};
  c.sa_ld = sa.ld;
  c.sb_ld = sb.ld;
  c.align[0] = Alignment(c.g.a, m * k, batch);
  c.align[1] = Alignment(c.g.b, n * k, batch);
  c.align[2] = Alignment(c.g.out, m * n * static_cast<int64_t>(c.batch.out_bytes), batch);
  c.align[3] = Alignment(c.g.a_scale, c.batch.a_scale_size * 4, batch);
  c.align[4] = Alignment(c.g.b_scale, c.batch.b_scale_size * 4, batch);
  c.cg = CutlassGemm{m,
                     n,
                     k,
                     batch,
                     c.g.a,
                     c.g.b,
                     static_cast<const float*>(c.g.a_scale),
                     static_cast<const float*>(c.g.b_scale),
                     c.g.out,
                     sa.ld,
                     sb.ld,
                     c.batch.a_scale_size,
                     c.batch.b_scale_size,
                     c.g.a_tile,
                     c.g.b_tile,
                     ot == ffi::DataType::BF16};
  c.e4m3 = c.g.a_type == kR8FE4M3 && c.g.b_type == kR8FE4M3;
  return c;
}

bool Empty(const Call& c) { return c.batch.count == 0 || c.g.m == 0 || c.g.n == 0 || c.g.k == 0; }

// Initialize stage (before any execution or command-buffer capture): makes the cuBLASLt
// handle and the plan, so that the execute stage only enqueues work.
ffi::Error BlockGemmInitialize(cudaStream_t, int32_t device, ffi::AnyBuffer a,
                               ffi::AnyBuffer a_scale, ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int32_t a_block_rows,
                               int32_t b_block_rows, int32_t kernel) {
  auto call = Decode(a, a_scale, b, b_scale, out, workspace, a_block_rows, b_block_rows);
  if (!call.has_value()) return call.error();
  if (Empty(*call) || kernel == kKernelFallback) return ffi::Error::Success();
  auto cutlass = CutlassChoice(*call, kernel);
  if (!cutlass.has_value()) return cutlass.error();
  if (*cutlass >= 0) {
    const ffi::Error err = CutlassSetupStatus(kName, CutlassConfigAt(*cutlass).prepare(device));
    if (err.failure()) return err;
  }
  FindPlan(call->g, call->align, device);  // also for CUTLASS: its fallback when it cannot run
  return ffi::Error::Success();
}

ffi::Error BlockGemmExecute(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                            ffi::AnyBuffer a_scale, ffi::AnyBuffer b, ffi::AnyBuffer b_scale,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                            int32_t a_block_rows, int32_t b_block_rows, int32_t kernel) {
  auto decoded = Decode(a, a_scale, b, b_scale, out, workspace, a_block_rows, b_block_rows);
  if (!decoded.has_value()) return decoded.error();
  const Call& c = *decoded;
  const Gemm& g = c.g;
  if (c.batch.count == 0 || g.m == 0 || g.n == 0) return ffi::Error::Success();
  if (g.k == 0) {
    const cudaError_t err =
        cudaMemsetAsync(g.out, 0, c.batch.count * g.m * g.n * c.batch.out_bytes, stream);
    return err == cudaSuccess ? ffi::Error::Success()
                              : ffi::Error::Internal(cudaGetErrorString(err));
  }
  if (kernel != kKernelFallback && kernel != kKernelCublasLt) {
    auto cutlass = CutlassChoice(c, kernel);
    if (!cutlass.has_value()) return cutlass.error();
    if (*cutlass >= 0) {
      const int err = CutlassConfigAt(*cutlass).run(c.cg, device, workspace->untyped_data(),
                                                    workspace->size_bytes(), stream);
      if (err > 0) {
        return ffi::Error::Internal(std::string(kName) + ": CUTLASS kernel failed: " +
                                    cudaGetErrorString(static_cast<cudaError_t>(err)));
      }
      if (err == 0) return ffi::Error::Success();
      if (kernel != kKernelAuto) {
        return ffi::Error::Internal(std::string(kName) + ": CUTLASS cannot implement this GEMM");
      }
    }
  }
  Plan* plan = kernel == kKernelFallback ? nullptr : FindPlan(g, c.align, device);
  if (plan && HasAlgorithm(*plan)) {
    const int status = RunPlan(*plan, device, g, c.batch, workspace->untyped_data(), stream);
    if (status != 0) {
      return ffi::Error::Internal(std::string(kName) + ": cublasLtMatmul failed with status " +
                                  std::to_string(status));
    }
    return ffi::Error::Success();
  }
  const uint8_t* pa = static_cast<const uint8_t*>(g.a);
  const uint8_t* pb = static_cast<const uint8_t*>(g.b);
  const float* psa = static_cast<const float*>(g.a_scale);
  const float* psb = static_cast<const float*>(g.b_scale);
  uint8_t* po = static_cast<uint8_t*>(g.out);
  for (int64_t i = 0; i < c.batch.count; ++i) {
    const BlockGemmArgs args{pa + i * g.m * g.k,
                             psa + i * c.batch.a_scale_size,
                             g.a_type == kR8FE5M2,
                             g.a_tile,
                             c.sa_ld,
                             pb + i * g.n * g.k,
                             psb + i * c.batch.b_scale_size,
                             g.b_type == kR8FE5M2,
                             g.b_tile,
                             c.sb_ld,
                             po + i * g.m * g.n * c.batch.out_bytes,
                             g.out_type == kR16BF,
                             g.m,
                             g.n,
                             g.k};
    const ffi::Error err = LaunchStatus(kName, LaunchBlockGemmFallback(stream, args));
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

}  // namespace

JAX_FP8_DEFINE_CUDA_HANDLER_BUNDLE(JaxFp8BlockGemmCuda, BlockGemmExecute,
                                   JaxFp8BlockGemmInitializeCuda, BlockGemmInitialize,
                                   .Arg<ffi::AnyBuffer>()      // a
                                       .Arg<ffi::AnyBuffer>()  // a_scale
                                       .Arg<ffi::AnyBuffer>()  // b
                                       .Arg<ffi::AnyBuffer>()  // b_scale
                                       .Ret<ffi::AnyBuffer>()  // out
                                       .Ret<ffi::AnyBuffer>()  // workspace
                                       .Attr<int32_t>("a_block_rows")
                                       .Attr<int32_t>("b_block_rows")
                                       .Attr<int32_t>("kernel"));

}  // namespace jax_fp8
