#pragma once
// The initialize and execute stages of the XLA FFI handlers that run one configuration of a
// CUTLASS GEMM family's table (grouped_gemm_cuda.cc, grouped_wgrad_cuda.cc,
// ragged_dot_cuda.cc), and the checks they share: each family states only its Decode, which
// checks the call strictly and picks the configuration, so that every family reports setup
// and launch failures alike (block_gemm_cuda.cc, which falls back to cuBLASLt, shares only
// the setup's status).
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda_runtime.h>

#include "cuda_handler_util.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// A decoded call: the arguments of the family's `run` and the index of the configuration
// (in the family's table) that runs them.
template <typename RunArgs>
struct CutlassCall {
  RunArgs c;
  int config;
};

// Whether every pointer is 16-byte aligned, as TMA's loads and stores need.
inline bool Aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Whether `workspace` is uint8[bytes]: a workspace XLA allocates as the handler's result.
inline bool WorkspaceIs(xla::ffi::AnyBuffer workspace, int64_t bytes) {
  return workspace.element_type() == xla::ffi::DataType::U8 && workspace.dimensions().size() == 1 &&
         workspace.dimensions()[0] == bytes;
}

// Success, or the failed `prepare` of a CUTLASS configuration (a cudaError_t) as an
// internal error naming the target.
inline xla::ffi::Error CutlassSetupStatus(const char* target, int err) {
  if (err == 0) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string(target) + ": CUTLASS setup failed: " +
                                   cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The stages of the handler of target `name`, for JAX_FP8_DEFINE_CUDA_HANDLER_BUNDLE. Decode
// takes the handler's buffers, results and attributes and returns the CutlassCall or the
// error to report; the stages take XLA's stream and the device ordinal, then Decode's
// parameters (the specialization below reads them from Decode's type).
// ConfigAt(i) is configuration i of the family's table (as grouped_gemm.h's
// GroupedGemmConfig): prepare(device) before any execution or command-buffer capture, and
// run(c, device, stream), which returns 0, a cudaError_t, or -1 where CUTLASS cannot
// implement the call or the workspace is short.
template <const char* name, auto ConfigAt, auto Decode, typename = decltype(Decode)>
struct CutlassHandler;

template <const char* name, auto ConfigAt, auto Decode, typename RunArgs, typename... Args>
struct CutlassHandler<name, ConfigAt, Decode,
                      xla::ffi::ErrorOr<CutlassCall<RunArgs>> (*)(Args...)> {
  static xla::ffi::Error Initialize(cudaStream_t, int32_t device, Args... args) {
    auto call = Decode(args...);
    if (!call.has_value()) return call.error();
    return CutlassSetupStatus(name, ConfigAt(call->config).prepare(device));
  }

  static xla::ffi::Error Execute(cudaStream_t stream, int32_t device, Args... args) {
    auto call = Decode(args...);
    if (!call.has_value()) return call.error();
    const int err = ConfigAt(call->config).run(call->c, device, stream);
    if (err < 0) {
      return xla::ffi::Error::Internal(std::string(name) +
                                       ": CUTLASS cannot implement this grouped GEMM (or its "
                                       "workspace is short of grouped_gemm_workspace.h's budget)");
    }
    return LaunchStatus(name, static_cast<cudaError_t>(err));
  }
};

}  // namespace jax_fp8
