// XLA FFI handler "jax_fp8_update" for the CUDA platform: decode, then one launch
// (per chunk) on XLA's stream. Command-buffer compatible: it only enqueues work.
#include "update_cuda_handler.h"

#include <string>

#include "cuda_handler_util.h"
#include "update_cuda.h"
#include "update_decode.h"

namespace jax_fp8 {
namespace {

ffi::Error UpdateCudaImpl(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                          ffi::Span<const float> scaled_max, int32_t algo, bool power_of_2_scale,
                          bool skip_unused, bool has_scale_inv, bool has_amax, bool in_place) {
  auto opt = DecodeOptions(algo, power_of_2_scale, skip_unused);
  if (!opt.has_value()) return opt.error();
  auto groups = DecodeGroups(args, rets, scaled_max, has_scale_inv, has_amax, in_place);
  if (!groups.has_value()) return groups.error();
  const char* why = nullptr;
  const cudaError_t err = LaunchUpdate(stream, groups->data(), groups->size(), *opt, &why);
  return LaunchStatus("jax_fp8_update", err, why);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFp8UpdateCuda, UpdateCudaImpl,
    JAX_FP8_UPDATE_ATTRS(
        ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().RemainingArgs().RemainingRets()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
