#pragma once
// The element types jax_fp8's CUDA kernels read (high-precision inputs) and write (FP8),
// named once for the kernels and the FFI handlers that decode them (cuda_handler_util.h);
// type_dispatch.h maps them to the kernels' C++ types.

namespace jax_fp8 {

enum class InType { kF32, kBF16, kF16 };
enum class Fp8Type { kE4M3FN, kE5M2 };

}  // namespace jax_fp8
