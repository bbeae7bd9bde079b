#pragma once
// The workspace of jax_fp8_grouped_gemm's custom call (a result buffer XLA allocates): one
// statement for the Python side (through grouped_gemm_limits.h and the modules) and the
// kernel (grouped_gemm_sm90.cuh). Plain C++.
#include <cstdint>

namespace jax_fp8 {

// Per-group arrays the device-side setup writes (problem shape, operand and output pointers,
// strides, alpha and its pointer: under 128 bytes, static_assert'ed in
// grouped_gemm_sm90.cuh), a header (the rows the groups cover) and CUTLASS's own workspace
// (two TMA descriptors per SM for the operands, the epilogue's, and its tile scheduler's:
// well under 1 MiB on any SM90 part; checked at run time).
constexpr int64_t kGroupedGemmHeaderBytes = 1024;
constexpr int64_t kGroupedGemmBytesPerGroup = 128;
constexpr int64_t kGroupedGemmCutlassBytes = int64_t{1} << 20;
// The largest G: the setup kernel scans group sizes with one thread block per call.
constexpr int64_t kGroupedGemmMaxGroups = int64_t{1} << 20;

inline int64_t GroupedGemmWorkspaceBytes(int64_t groups) {
  return kGroupedGemmHeaderBytes + groups * kGroupedGemmBytesPerGroup + kGroupedGemmCutlassBytes;
}

}  // namespace jax_fp8
