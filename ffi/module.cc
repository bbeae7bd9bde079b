// nanobind glue: exposes the FFI handlers as capsules, keyed by target name, for
// jax.ffi.register_ffi_target (see jax_fp8/_registration.py). Built twice: as
// _jax_fp8_cpu (no CUDA) and, when CUDA is enabled, as _jax_fp8_cuda, so the CPU
// path never needs the CUDA runtime.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#if defined(JAX_FP8_CUDA_MODULE)
#include "block_gemm_cuda.h"
#include "block_quantize_cuda_handler.h"
#include "split_cuda_handler.h"
#include "transpose_cuda.h"
#include "transpose_cuda_handler.h"
#include "update_cuda_handler.h"
#define JAX_FP8_HANDLER JaxFp8UpdateCuda
#else
#include "split_cpu.h"
#include "update_cpu.h"
#define JAX_FP8_HANDLER JaxFp8UpdateCpu
#endif

namespace nb = nanobind;

NB_MODULE(JAX_FP8_MODULE_NAME, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_fp8_update"] = nb::capsule(reinterpret_cast<void*>(&jax_fp8::JAX_FP8_HANDLER));
#if defined(JAX_FP8_CUDA_MODULE)
    // GPU only: on the CPU these lower to XLA's own ops (see _primitives/layout.py).
    d["jax_fp8_transpose_bytes"] =
        nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8TransposeBytesCuda));
    d["jax_fp8_quantize_transpose"] =
        nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8QuantizeTransposeCuda));
    // A packed state's scale vectors, one buffer per state (both platforms).
    d["jax_fp8_split_rows"] = nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8SplitRowsCuda));
    // GPU only: elsewhere the blockwise primitives lower to jax.numpy (_primitives/block_*.py).
    d["jax_fp8_block_quantize"] =
        nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8BlockQuantizeCuda));
    nb::dict gemm;  // a handler bundle: jax.ffi.register_ffi_target takes stage -> capsule
    gemm["initialize"] =
        nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8BlockGemmInitializeCuda));
    gemm["execute"] = nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8BlockGemmCuda));
    d["jax_fp8_block_gemm"] = gemm;
#else
    d["jax_fp8_split_rows"] = nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8SplitRowsCpu));
#endif
    return d;
  });
#if defined(JAX_FP8_CUDA_MODULE)
  // The sizes the transpose kernels take (one source: the launcher's own check).
  m.def("transpose_bytes_supports", &jax_fp8::TransposeBytesSupports, nb::arg("batch"),
        nb::arg("rows"), nb::arg("cols"));
  // dlopen()s libcublasLt (never linked) for jax_fp8_block_gemm: (version, error).
  m.def("load_cublaslt", [](const std::string& path) {
    std::string error;
    const size_t version = jax_fp8::LoadCublasLt(path, &error);
    return std::make_pair(version, error);
  });
#endif
}
