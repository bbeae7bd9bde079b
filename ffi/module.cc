// nanobind glue: the table of jax_fp8's FFI targets, and their handlers as capsules for
// jax.ffi.register_ffi_target (see jax_fp8/_registration.py). Built twice: as
// _jax_fp8_cpu (no CUDA) and, when CUDA is enabled, as _jax_fp8_cuda, so the CPU path
// never needs the CUDA runtime. Both modules carry the whole table; each registers the
// handlers of its own platform.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <string>

#include "block_gemm_limits.h"
#include "grouped_gemm_limits.h"
#include "grouped_wgrad_limits.h"
#include "ragged_dot_limits.h"

#if defined(JAX_FP8_CUDA_MODULE)
#include "block_gemm_cublaslt.h"
#include "block_gemm_cuda.h"
#include "block_gemm_cutlass.h"
#include "block_quantize_cuda.h"
#include "block_quantize_cuda_handler.h"
#include "grouped_gemm.h"
#include "grouped_gemm_cuda.h"
#include "grouped_wgrad.h"
#include "grouped_wgrad_cuda.h"
#include "ragged_dot.h"
#include "ragged_dot_cuda.h"
#include "split_cuda_handler.h"
#include "transpose_cuda.h"
#include "transpose_cuda_handler.h"
#include "update_cuda_handler.h"
#else
#include "split_cpu.h"
#include "update_cpu.h"
#endif

namespace nb = nanobind;

namespace {

// A handler of a full build: `exists` whether the target has one on that platform,
// `fn` its address in this module (null in the other platform's module).
struct Handler {
  bool exists;
  void* fn;
};

#define JAX_FP8_ADDRESS(symbol) reinterpret_cast<void*>(&jax_fp8::symbol)
// Unformatted: clang-format would space out the braces of these initializers.
// clang-format off
#if defined(JAX_FP8_CUDA_MODULE)
#define JAX_FP8_CPU(symbol) Handler{true, nullptr}
#define JAX_FP8_CUDA(symbol) Handler{true, JAX_FP8_ADDRESS(symbol)}
#else
#define JAX_FP8_CPU(symbol) Handler{true, JAX_FP8_ADDRESS(symbol)}
#define JAX_FP8_CUDA(symbol) Handler{true, nullptr}
#endif
#define JAX_FP8_NONE Handler{false, nullptr}
// clang-format on

struct Target {
  const char* name;
  Handler cpu, cuda;
  Handler cuda_initialize;  // an initialize stage, registered as a handler bundle with `cuda`
  const char* cuda_kernel;  // the __global__ function it launches, as profiles name it
};

// Every custom-call target jax_fp8 emits. Elsewhere (a platform without a handler) the
// primitive lowers to XLA's own ops (jax_fp8/_primitives/).
const Target kTargets[] = {
    {"jax_fp8_update", JAX_FP8_CPU(JaxFp8UpdateCpu), JAX_FP8_CUDA(JaxFp8UpdateCuda), JAX_FP8_NONE,
     "UpdateKernel"},
    {"jax_fp8_transpose_bytes", JAX_FP8_NONE, JAX_FP8_CUDA(JaxFp8TransposeBytesCuda), JAX_FP8_NONE,
     "TransposeBytesKernel"},
    {"jax_fp8_quantize_transpose", JAX_FP8_NONE, JAX_FP8_CUDA(JaxFp8QuantizeTransposeCuda),
     JAX_FP8_NONE, "QuantizeTransposeKernel"},
    {"jax_fp8_block_quantize", JAX_FP8_NONE, JAX_FP8_CUDA(JaxFp8BlockQuantizeCuda), JAX_FP8_NONE,
     "BlockQuantizeKernel"},
    {"jax_fp8_block_gemm", JAX_FP8_NONE, JAX_FP8_CUDA(JaxFp8BlockGemmCuda),
     JAX_FP8_CUDA(JaxFp8BlockGemmInitializeCuda), "BlockGemmFallbackKernel"},
    {"jax_fp8_grouped_gemm", JAX_FP8_NONE, JAX_FP8_CUDA(JaxFp8GroupedGemmCuda),
     JAX_FP8_CUDA(JaxFp8GroupedGemmInitializeCuda), "GroupedGemmSetupKernel"},
    {"jax_fp8_grouped_wgrad", JAX_FP8_NONE, JAX_FP8_CUDA(JaxFp8GroupedWgradCuda),
     JAX_FP8_CUDA(JaxFp8GroupedWgradInitializeCuda), "GroupedWgradSetupKernel"},
    {"jax_fp8_ragged_dot", JAX_FP8_NONE, JAX_FP8_CUDA(JaxFp8RaggedDotCuda),
     JAX_FP8_CUDA(JaxFp8RaggedDotInitializeCuda), "RaggedDotSetupKernel"},
    {"jax_fp8_split_rows", JAX_FP8_CPU(JaxFp8SplitRowsCpu), JAX_FP8_CUDA(JaxFp8SplitRowsCuda),
     JAX_FP8_NONE, "SplitRowsKernel"},
};

nb::capsule Capsule(void* fn) { return nb::capsule(fn); }

// An element type by its NumPy name (numpy.dtype(t).name); INVALID for the others.
xla::ffi::DataType DataTypeNamed(const std::string& name) {
  using xla::ffi::DataType;
  if (name == "float8_e4m3fn") return DataType::F8E4M3FN;
  if (name == "float8_e5m2") return DataType::F8E5M2;
  if (name == "bfloat16") return DataType::BF16;
  if (name == "float16") return DataType::F16;
  if (name == "float32") return DataType::F32;
  return DataType::INVALID;
}

}  // namespace

NB_MODULE(JAX_FP8_MODULE_NAME, m) {
  // [(name, platforms with a handler, CUDA kernel name)], the same in both modules.
  m.def("targets", []() {
    nb::list out;
    for (const Target& t : kTargets) {
      nb::list platforms;
      if (t.cpu.exists) platforms.append("cpu");
      if (t.cuda.exists) platforms.append("cuda");
      out.append(nb::make_tuple(t.name, nb::tuple(platforms), t.cuda_kernel));
    }
    return out;
  });
  // {name: capsule, or {stage: capsule} for a bundle} of this module's handlers.
  m.def("registrations", []() {
    nb::dict d;
    for (const Target& t : kTargets) {
#if defined(JAX_FP8_CUDA_MODULE)
      const Handler& h = t.cuda;
#else
      const Handler& h = t.cpu;
#endif
      if (!h.fn) continue;
      if (t.cuda_initialize.fn) {
        nb::dict bundle;
        bundle["initialize"] = Capsule(t.cuda_initialize.fn);
        bundle["execute"] = Capsule(h.fn);
        d[t.name] = bundle;
      } else {
        d[t.name] = Capsule(h.fn);
      }
    }
    return d;
  });
  // The GEMMs jax_fp8_block_gemm's custom call takes (block_gemm_limits.h), types by their
  // NumPy names; in both modules, as the limits need no CUDA.
  m.def(
      "block_gemm_supports",
      [](const std::string& a_type, const std::string& b_type, const std::string& out_type,
         bool a_tile, bool b_tile, int64_t batch, int64_t m, int64_t n, int64_t k) {
        return jax_fp8::BlockGemmSupports(DataTypeNamed(a_type), DataTypeNamed(b_type),
                                          DataTypeNamed(out_type), a_tile, b_tile, batch, m, n, k);
      },
      nb::arg("a_type"), nb::arg("b_type"), nb::arg("out_type"), nb::arg("a_tile"),
      nb::arg("b_tile"), nb::arg("batch"), nb::arg("m"), nb::arg("n"), nb::arg("k"));
  // The grouped GEMMs jax_fp8_grouped_gemm's custom call takes (grouped_gemm_limits.h) and
  // the bytes of its workspace result; in both modules, as neither needs CUDA.
  m.def(
      "grouped_gemm_supports",
      [](const std::string& lhs_type, const std::string& rhs_type, const std::string& out_type,
         int64_t m, int64_t n, int64_t k, int64_t groups) {
        return jax_fp8::GroupedGemmSupports(DataTypeNamed(lhs_type), DataTypeNamed(rhs_type),
                                            DataTypeNamed(out_type), m, n, k, groups);
      },
      nb::arg("lhs_type"), nb::arg("rhs_type"), nb::arg("out_type"), nb::arg("m"), nb::arg("n"),
      nb::arg("k"), nb::arg("groups"));
  m.def("grouped_gemm_workspace_bytes", &jax_fp8::GroupedGemmWorkspaceBytes, nb::arg("groups"));
  // The weight gradients jax_fp8_grouped_wgrad's custom call takes (grouped_wgrad_limits.h;
  // its workspace is the grouped GEMM's).
  m.def(
      "grouped_wgrad_supports",
      [](const std::string& lhs_type, const std::string& grad_type, const std::string& out_type,
         int64_t k, int64_t n, int64_t mp, int64_t groups) {
        return jax_fp8::GroupedWgradSupports(DataTypeNamed(lhs_type), DataTypeNamed(grad_type),
                                             DataTypeNamed(out_type), k, n, mp, groups);
      },
      nb::arg("lhs_type"), nb::arg("grad_type"), nb::arg("out_type"), nb::arg("k"), nb::arg("n"),
      nb::arg("mp"), nb::arg("groups"));
  // The 16-bit grouped GEMMs jax_fp8_ragged_dot's custom call takes (ragged_dot_limits.h;
  // its workspace is the grouped GEMM's), `mode` a RaggedDotMode (ragged_dot.h).
  m.def(
      "ragged_dot_supports",
      [](int mode, const std::string& in_type, const std::string& out_type, int64_t m, int64_t k,
         int64_t n, int64_t groups) {
        return jax_fp8::RaggedDotSupports(mode, DataTypeNamed(in_type), DataTypeNamed(out_type), m,
                                          k, n, groups);
      },
      nb::arg("mode"), nb::arg("in_type"), nb::arg("out_type"), nb::arg("m"), nb::arg("k"),
      nb::arg("n"), nb::arg("groups"));
#if defined(JAX_FP8_CUDA_MODULE)
  // The sizes the transpose kernels take (one source: the launcher's own check).
  m.def("transpose_bytes_supports", &jax_fp8::TransposeBytesSupports, nb::arg("batch"),
        nb::arg("rows"), nb::arg("cols"));
  // The sizes the block-quantization kernel takes (one source: its launcher's check).
  m.def("block_quantize_supports", &jax_fp8::BlockQuantizeSupports, nb::arg("batch"),
        nb::arg("rows"), nb::arg("cols"));
  // dlopen()s libcublasLt (never linked) for jax_fp8_block_gemm: (version, error).
  m.def("load_cublaslt", [](const std::string& path) {
    std::string error;
    const size_t version = jax_fp8::LoadCublasLt(path, &error);
    return std::make_pair(version, error);
  });
  // The CUTLASS configurations of jax_fp8_block_gemm compiled into this module, in the
  // order of its `kernel` attribute (empty when CUTLASS's headers were not found at build).
  m.def("cutlass_configs", []() {
    nb::list out;
    for (int i = 0; i < jax_fp8::CutlassConfigCount(); ++i) {
      const jax_fp8::CutlassConfig& c = jax_fp8::CutlassConfigAt(i);
      out.append(nb::make_tuple(c.name, c.b_tile, c.out_bf16));
    }
    return out;
  });
  // The grouped GEMM configurations compiled into this module: [(name, lhs E5M2, bf16 out)]
  // (empty when CUTLASS's headers were not found at build).
  m.def("grouped_gemm_configs", []() {
    nb::list out;
    for (int i = 0; i < jax_fp8::GroupedGemmConfigCount(); ++i) {
      const jax_fp8::GroupedGemmConfig& c = jax_fp8::GroupedGemmConfigAt(i);
      out.append(nb::make_tuple(c.name, c.lhs_e5m2, c.out_bf16));
    }
    return out;
  });
  // The weight-gradient configurations compiled into this module: [(name, grad E5M2, bf16
  // out)] (empty when CUTLASS's headers were not found at build).
  m.def("grouped_wgrad_configs", []() {
    nb::list out;
    for (int i = 0; i < jax_fp8::GroupedWgradConfigCount(); ++i) {
      const jax_fp8::GroupedWgradConfig& c = jax_fp8::GroupedWgradConfigAt(i);
      out.append(nb::make_tuple(c.name, c.grad_e5m2, c.out_bf16));
    }
    return out;
  });
  // The 16-bit grouped GEMM configurations compiled into this module: [(name, mode, f16
  // operands, float32 out)] (empty when CUTLASS's headers were not found at build).
  m.def("ragged_dot_configs", []() {
    nb::list out;
    for (int i = 0; i < jax_fp8::RaggedDotConfigCount(); ++i) {
      const jax_fp8::RaggedDotConfig& c = jax_fp8::RaggedDotConfigAt(i);
      out.append(nb::make_tuple(c.name, c.mode, c.in_f16, c.out_float));
    }
    return out;
  });
#endif
}
