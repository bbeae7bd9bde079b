#pragma once
// The initialize and execute stages of the XLA FFI handlers that run one configuration of a
// CUTLASS GEMM family's table (grouped_gemm_cuda.cc, grouped_wgrad_cuda.cc,
// ragged_dot_cuda.cc), and the checks they share (group sizes, workspace, alignment, a
// compiled configuration): each family states only its Decode, which checks the call
// strictly and picks the configuration, so that every family reports setup
// and launch failures alike (block_gemm_cuda.cc, which falls back to cuBLASLt, shares only
// the setup's status).
#include <cstdint>
#include <initializer_list>
#include <string>

#include <cuda_runtime.h>

#include "cuda_handler_util.h"
#include "grouped_gemm_workspace.h"
#include "handler_util.h"
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

// Whether `b` is a vector of `g` elements of type `t` (group sizes, per-group scales).
inline bool IsVector(xla::ffi::AnyBuffer b, xla::ffi::DataType t, int64_t g) {
  return b.element_type() == t && b.dimensions().size() == 1 && b.dimensions()[0] == g;
}

// Success if group_sizes is int32[G] as the grouped families take it, else the error naming
// the target (`g_is` says where G comes from, e.g. "G = rhs.shape[0]").
inline xla::ffi::Error CheckGroupSizes(const char* target, xla::ffi::AnyBuffer group_sizes,
                                       int64_t g, const std::string& g_is) {
  if (IsVector(group_sizes, xla::ffi::DataType::S32, g)) return xla::ffi::Error::Success();
  return InvalidArgument(target, "group_sizes must be int32[G], " + g_is + " = " +
                                     std::to_string(g) + ", got " +
                                     ShapeString(group_sizes.dimensions()));
}

// The checks the grouped families make last: the workspace of grouped_gemm_workspace.h for
// `g` groups, the operands, output and workspace 16-byte aligned (TMA's loads and stores;
// `names` lists the buffers for the message) and a compiled configuration (`config` >= 0;
// `what` says what none was compiled for). The workspace's bytes, or the error naming the
// target.
inline xla::ffi::ErrorOr<int64_t> CheckGroupedRun(const char* target, int64_t g,
                                                  xla::ffi::AnyBuffer workspace,
                                                  std::initializer_list<const void*> buffers,
                                                  const char* names, int config, const char* what) {
  const int64_t need = GroupedGemmWorkspaceBytes(g);
  if (!WorkspaceIs(workspace, need)) {
    return xla::ffi::Unexpected(
        InvalidArgument(target, "the workspace must be uint8[" + std::to_string(need) + "]"));
  }
  if (!Aligned16(buffers) || !Aligned16({workspace.untyped_data()})) {
    return xla::ffi::Unexpected(
        InvalidArgument(target, std::string(names) + " and the workspace must be 16-byte aligned"));
  }
  if (config < 0) {
    return xla::ffi::Unexpected(
        InvalidArgument(target, std::string("no kernel compiled for ") + what +
                                    " (the module was built without CUTLASS's headers, or "
                                    "JAX_FP8_CUTLASS=OFF)"));
  }
  return need;
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
