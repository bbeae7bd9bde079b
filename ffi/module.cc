// nanobind glue: exposes the FFI handlers as capsules, keyed by target name, for
// jax.ffi.register_ffi_target (see jax_fp8/_registration.py). Built twice: as
// _jax_fp8_cpu (no CUDA) and, when CUDA is enabled, as _jax_fp8_cuda, so the CPU
// path never needs the CUDA runtime.
#include <nanobind/nanobind.h>

#if defined(JAX_FP8_CUDA_MODULE)
#include "transpose_cuda_handler.h"
#include "update_cuda_handler.h"
#define JAX_FP8_HANDLER JaxFp8UpdateCuda
#else
#include "update_cpu.h"
#define JAX_FP8_HANDLER JaxFp8UpdateCpu
#endif

namespace nb = nanobind;

NB_MODULE(JAX_FP8_MODULE_NAME, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_fp8_update"] = nb::capsule(reinterpret_cast<void*>(&jax_fp8::JAX_FP8_HANDLER));
#if defined(JAX_FP8_CUDA_MODULE)
    // GPU only: on the CPU these lower to XLA's own ops (see jax_fp8/_transpose.py).
    d["jax_fp8_transpose_bytes"] =
        nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8TransposeBytesCuda));
    d["jax_fp8_quantize_transpose"] =
        nb::capsule(reinterpret_cast<void*>(&jax_fp8::JaxFp8QuantizeTransposeCuda));
#endif
    return d;
  });
}
