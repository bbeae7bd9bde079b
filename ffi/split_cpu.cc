// CPU handler of "jax_fp8_split_rows": the pieces copied out of the packed vector (what
// XLA's slices compute). As one custom call, a packed state's scale vector has one user
// in the step instead of one slice per state, which XLA:CPU's fusion passes compile
// faster.
#include "split_cpu.h"

#include <cstring>

#include "handler_util.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
namespace {

ffi::Error SplitRowsCpuImpl(ffi::AnyBuffer src, ffi::RemainingRets pieces) {
  auto call = DecodeSplitRows(src, pieces);
  if (!call.has_value()) return call.error();
  const float* from = call->src;
  for (size_t k = 0; k < call->dsts.size(); ++k) {
    if (call->counts[k] > 0) std::memcpy(call->dsts[k], from, sizeof(float) * call->counts[k]);
    from += call->counts[k];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp8SplitRowsCpu, SplitRowsCpuImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().RemainingRets());

}  // namespace jax_fp8
