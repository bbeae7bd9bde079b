#pragma once
// The one dispatch from the element types a call decoded (element_types.h) to the kernels'
// compile-time types, for every kernel that reads an input type and writes an FP8 type:
//
//   return DispatchTypes(in_type, fp8_type, cudaErrorInvalidValue, [&](auto in, auto fp8) {
//     using In = typename decltype(in)::type;   // float, __nv_bfloat16 or __half
//     constexpr Fp8Type kFp8 = decltype(fp8)::value;
//     return LaunchTyped<In, kFp8>(...);
//   });
//
// One instantiation per (input type, FP8 type) pair. A value outside the enums gives
// `invalid`; the FFI handlers never pass one (cuda_handler_util.h's DecodeInType and
// DecodeFp8Type refuse every other element type with the handler's error).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "element_types.h"

namespace jax_fp8 {

// A type as a value: `typename decltype(tag)::type` in a generic lambda.
template <typename T>
struct TypeTag {
  using type = T;
};

// An FP8 type as a value: `decltype(tag)::value` is a constant expression.
template <Fp8Type kFp8>
using Fp8Tag = std::integral_constant<Fp8Type, kFp8>;

// f(TypeTag<In>{}) for the C++ type In that reads `in_type`; `invalid` for no such type.
template <typename R, typename F>
R DispatchInType(InType in_type, R invalid, F&& f) {
  switch (in_type) {
    case InType::kF32: return f(TypeTag<float>{});
    case InType::kBF16: return f(TypeTag<__nv_bfloat16>{});
    case InType::kF16: return f(TypeTag<__half>{});
  }
  return invalid;
}

// f(Fp8Tag<fp8_type>{}); `invalid` for no such type.
template <typename R, typename F>
R DispatchFp8Type(Fp8Type fp8_type, R invalid, F&& f) {
  switch (fp8_type) {
    case Fp8Type::kE4M3FN: return f(Fp8Tag<Fp8Type::kE4M3FN>{});
    case Fp8Type::kE5M2: return f(Fp8Tag<Fp8Type::kE5M2>{});
  }
  return invalid;
}

// f(TypeTag<In>{}, Fp8Tag<kFp8>{}) for both types; `invalid` if either has no type.
template <typename R, typename F>
R DispatchTypes(InType in_type, Fp8Type fp8_type, R invalid, F&& f) {
  return DispatchInType(in_type, invalid, [&](auto in) {
    return DispatchFp8Type(fp8_type, invalid, [&](auto fp8) { return f(in, fp8); });
  });
}

}  // namespace jax_fp8
