#pragma once
// cuBLASLt for the block-scaled FP8 GEMM: the library dlopen()ed at first use (never
// linked) and, per (device, shape, types, block modes, pointer alignments), a plan made
// once and kept (matmul descriptor, layouts, the heuristic's algorithm).
//
// cuBLASLt is column-major; the row-major out [M, N] = a [M, K] . b [N, K]^T is its
// D (N x M) = op(A) . B with A = b (stored K x N, transa = T), B = a (stored K x M,
// transb = N): Hopper's FP8 GEMMs take only this "TN" form. A's scales are b's, B's are a's.
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

namespace jax_fp8 {

// cudaDataType_t codes of the operand and output types.
constexpr int32_t kR32F = 0, kR16BF = 14, kR8FE4M3 = 28, kR8FE5M2 = 29;

struct Gemm {       // one GEMM of a batch, as cuBLASLt sees it
  int64_t m, n, k;  // row-major out [m, n] = a [m, k] . b [n, k]^T
  int32_t a_type, b_type, out_type;
  bool a_tile, b_tile;
  const void *a, *b, *a_scale, *b_scale;
  void* out;
  size_t workspace_bytes;
};

// The strides from one GEMM of a batch to the next.
struct GemmBatch {
  int64_t count, a_scale_size, b_scale_size;
  size_t out_bytes;  // bytes of one output element
};

// dlopen()s libcublasLt at `path` and resolves the entry points used here; returns
// cublasLtGetVersion() (e.g. 120900), or 0 with *error set. Once a library is loaded,
// later calls return its version whatever the path. Host only: needs no GPU.
size_t LoadCublasLt(const std::string& path, std::string* error);

// The largest power of two (<= 256) dividing the address of every batch element.
uint32_t Alignment(const void* p, int64_t batch_stride_bytes, int64_t batch);

struct Plan;

// The cached plan for this GEMM on `device` (made now if new), or null while no cuBLASLt
// is loaded. align: the alignments of a, b, out, a_scale, b_scale.
Plan* FindPlan(const Gemm& g, const uint32_t (&align)[5], int32_t device);

// Whether cuBLASLt found an algorithm for the plan (else the fallback kernel runs).
bool HasAlgorithm(const Plan& plan);

// Enqueues the batch's GEMMs with the plan; 0 on success, else cuBLASLt's status.
int RunPlan(Plan& plan, int32_t device, const Gemm& g, const GemmBatch& batch, void* workspace,
            cudaStream_t stream);

}  // namespace jax_fp8
