#pragma once
// Pieces every CUDA FFI handler shares (besides handler_util.h's): the decode of the
// input and FP8 element types, the status of a launch, and the symbols of a handler bundle
// with an initialize stage.
#include <string>

#include <cuda_runtime.h>

#include "element_types.h"
#include "handler_util.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

// The input types the quantizing kernels read: f32, bf16, f16; false for any other.
inline bool DecodeInType(xla::ffi::DataType t, InType* out) {
  switch (t) {
    case xla::ffi::DataType::F32: *out = InType::kF32; return true;
    case xla::ffi::DataType::BF16: *out = InType::kBF16; return true;
    case xla::ffi::DataType::F16: *out = InType::kF16; return true;
    default: return false;
  }
}

// The FP8 types the kernels write: f8e4m3fn, f8e5m2; false for any other.
inline bool DecodeFp8Type(xla::ffi::DataType t, Fp8Type* out) {
  switch (t) {
    case xla::ffi::DataType::F8E4M3FN: *out = Fp8Type::kE4M3FN; return true;
    case xla::ffi::DataType::F8E5M2: *out = Fp8Type::kE5M2; return true;
    default: return false;
  }
}

// Success, or the failed launch as an internal error naming the target (and the
// launcher's own reason, where it gave one).
inline xla::ffi::Error LaunchStatus(const char* target, cudaError_t err,
                                    const char* why = nullptr) {
  if (err == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(
      std::string(target) + ": CUDA launch failed: " + (why ? why : cudaGetErrorString(err)));
}

}  // namespace jax_fp8

// The binding of a CUDA handler's stage (kInitialize or kExecute) up to its own
// parameters: XLA's stream and the device ordinal.
#define JAX_FP8_CUDA_STAGE_BINDING(stage)                    \
  ::xla::ffi::Ffi::Bind<::xla::ffi::ExecutionStage::stage>() \
      .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()       \
      .Ctx<::xla::ffi::DeviceOrdinal>()

// Defines the two symbols of a handler bundle whose stages take XLA's stream, the device
// ordinal, then what the binding chain `...` binds (such as
// `.Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>().Attr<int64_t>("m")`): `initialize`
// runs `initialize_impl` at the initialize stage (setup, before any execution or
// command-buffer capture), `execute` runs `execute_impl`, command-buffer compatible (it only
// enqueues work on the stream).
#define JAX_FP8_DEFINE_CUDA_HANDLER_BUNDLE(execute, execute_impl, initialize, initialize_impl, \
                                           ...)                                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(initialize, initialize_impl,                                   \
                                JAX_FP8_CUDA_STAGE_BINDING(kInitialize) __VA_ARGS__);          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(execute, execute_impl,                                         \
                                JAX_FP8_CUDA_STAGE_BINDING(kExecute) __VA_ARGS__,              \
                                {::xla::ffi::Traits::kCmdBufferCompatible})
