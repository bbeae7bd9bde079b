// Decoding and validating the variadic FFI call into TensorGroups; shared by the
// CPU and the CUDA handler so both accept and reject exactly the same calls.
//
// Operand order (G = scaled_max.size()):
//   history[0..G), scale[0..G), scale_inv[0..G) if has_scale_inv, amax[0..G) if has_amax
// Result order: history[0..G), scale[0..G), scale_inv[0..G).
// In place (`in_place`), history and scale results (and scale_inv, when it is an
// operand) alias their operands; the handlers check it. Out of place every result is a
// buffer of its own (the layout XLA compiles fastest for thousands of states).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "handler_util.h"
#include "scaling_math.h"
#include "tensor_group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

namespace ffi = xla::ffi;

#define JAX_FP8_UPDATE_ATTRS(binding)             \
  (binding)                                       \
      .Attr<ffi::Span<const float>>("scaled_max") \
      .Attr<int32_t>("amax_compute_algo")         \
      .Attr<bool>("power_of_2_scale")             \
      .Attr<bool>("skip_unused")                  \
      .Attr<bool>("has_scale_inv")                \
      .Attr<bool>("has_amax")                     \
      .Attr<bool>("in_place")

inline ffi::Error InvalidArg(const std::string& msg) {
  return InvalidArgument("jax_fp8_update", msg);
}

inline ffi::ErrorOr<UpdateOptions> DecodeOptions(int32_t algo, bool power_of_2_scale,
                                                 bool skip_unused) {
  if (algo != static_cast<int32_t>(AmaxAlgo::kMax) &&
      algo != static_cast<int32_t>(AmaxAlgo::kMostRecent)) {
    return ffi::Unexpected(InvalidArg("unknown amax_compute_algo " + std::to_string(algo)));
  }
  return UpdateOptions{static_cast<AmaxAlgo>(algo), power_of_2_scale, skip_unused};
}

inline ffi::ErrorOr<ffi::AnyBuffer> F32Arg(ffi::RemainingArgs& args, size_t i) {
  auto buf = args.get<ffi::AnyBuffer>(i);
  if (!buf.has_value()) return ffi::Unexpected(buf.error());
  if (buf->element_type() != ffi::DataType::F32) {
    return ffi::Unexpected(InvalidArg("operand " + std::to_string(i) + " is not float32"));
  }
  return *buf;
}

inline ffi::ErrorOr<ffi::AnyBuffer> F32Ret(ffi::RemainingRets& rets, size_t i) {
  auto buf = rets.get<ffi::AnyBuffer>(i);
  if (!buf.has_value()) return ffi::Unexpected(buf.error());
  if ((*buf)->element_type() != ffi::DataType::F32) {
    return ffi::Unexpected(InvalidArg("result " + std::to_string(i) + " is not float32"));
  }
  return **buf;
}

inline ffi::ErrorOr<std::vector<TensorGroup>> DecodeGroups(ffi::RemainingArgs args,
                                                           ffi::RemainingRets rets,
                                                           ffi::Span<const float> scaled_max,
                                                           bool has_scale_inv, bool has_amax,
                                                           bool in_place) {
  const size_t g_count = scaled_max.size();
  const size_t want_args = g_count * (2 + (has_scale_inv ? 1 : 0) + (has_amax ? 1 : 0));
  if (args.size() != want_args || rets.size() != 3 * g_count) {
    return ffi::Unexpected(InvalidArg(
        "expected " + std::to_string(want_args) + " operands and " + std::to_string(3 * g_count) +
        " results for " + std::to_string(g_count) + " states, got " + std::to_string(args.size()) +
        " and " + std::to_string(rets.size())));
  }
  std::vector<TensorGroup> groups;
  groups.reserve(g_count);
  for (size_t g = 0; g < g_count; ++g) {
    const std::string which = "state " + std::to_string(g) + ": ";
    auto hist = F32Arg(args, g);
    auto scale = F32Arg(args, g_count + g);
    auto hist_out = F32Ret(rets, g);
    auto scale_out = F32Ret(rets, g_count + g);
    auto sinv_out = F32Ret(rets, 2 * g_count + g);
    for (auto* b : {&hist, &scale, &hist_out, &scale_out, &sinv_out}) {
      if (!b->has_value()) return ffi::Unexpected(b->error());
    }
    const auto dims = hist->dimensions();
    if (dims.size() < 1 || dims.back() < 1) {
      return ffi::Unexpected(InvalidArg(which + "history must have a last axis of length >= 1"));
    }
    const int64_t len = dims.back();
    const int64_t count = static_cast<int64_t>(hist->element_count()) / len;
    const auto sdims = scale->dimensions();
    bool same = sdims.size() + 1 == dims.size();
    for (size_t d = 0; same && d < sdims.size(); ++d) same = sdims[d] == dims[d];
    if (!same || sinv_out->element_count() != static_cast<size_t>(count) ||
        hist_out->element_count() != hist->element_count()) {
      return ffi::Unexpected(InvalidArg(which + "scale shape must be history shape[:-1]"));
    }
    const bool aliased = hist_out->untyped_data() == hist->untyped_data() &&
                         scale_out->untyped_data() == scale->untyped_data();
    if (in_place != aliased) {
      return ffi::Unexpected(
          InvalidArg(which + (in_place ? "state results must alias their operands"
                                       : "out-of-place results must not alias their operands")));
    }
    const float* amax = nullptr;
    size_t next = 2 * g_count;
    if (has_scale_inv) {
      auto sinv = F32Arg(args, next + g);
      if (!sinv.has_value()) return ffi::Unexpected(sinv.error());
      if (sinv->element_count() != static_cast<size_t>(count) ||
          (in_place && sinv->untyped_data() != sinv_out->untyped_data())) {
        return ffi::Unexpected(
            InvalidArg(which + "scale_inv must match scale and alias its result"));
      }
      next += g_count;
    }
    if (has_amax) {
      auto am = F32Arg(args, next + g);
      if (!am.has_value()) return ffi::Unexpected(am.error());
      if (am->element_count() != static_cast<size_t>(count)) {
        return ffi::Unexpected(InvalidArg(which + "amax must have the shape of scale"));
      }
      amax = static_cast<const float*>(am->untyped_data());
    }
    groups.push_back(TensorGroup{static_cast<float*>(hist->untyped_data()),
                                 static_cast<float*>(scale->untyped_data()),
                                 static_cast<float*>(sinv_out->untyped_data()), amax, count, len,
                                 scaled_max[g], static_cast<float*>(hist_out->untyped_data()),
                                 static_cast<float*>(scale_out->untyped_data())});
  }
  return groups;
}

}  // namespace jax_fp8
