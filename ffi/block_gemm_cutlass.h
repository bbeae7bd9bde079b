#pragma once
// The block-scaled FP8 GEMMs built on CUTLASS's SM90 blockwise-scaled collective
// (ffi/block_gemm_cutlass_sm90.cuh, one instantiation per configuration file), for
// E4M3 x E4M3 with `a` in 1 x 128 blocks and `b` in 128 x 128 tiles (the forward and data
// gradient GEMMs) or 1 x 128 blocks (the weight gradient GEMM), bf16 or float32 out.
// Each K block of 128 is summed by the tensor cores, then scaled by the two blocks'
// scale_inv and added to a float32 accumulator, as cuBLASLt's block-scaled GEMM does.
//
// The configurations are compiled only for sm_90a and only when CUTLASS's headers were
// found at build time (JAX_FP8_HAS_CUTLASS); otherwise the table below is empty and every
// GEMM runs through cuBLASLt.
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace jax_fp8 {

// One batched GEMM, row-major out [batch, m, n] = a [batch, m, k] . b [batch, n, k]^T,
// the scales in block_scale_layout.h's layout (padded minor extents *_scale_ld,
// *_scale_size floats per GEMM of the batch).
struct CutlassGemm {
  int64_t m, n, k, batch;
  const void *a, *b;
  const float *a_scale, *b_scale;
  void* out;
  int64_t a_scale_ld, b_scale_ld, a_scale_size, b_scale_size;
  bool a_tile;    // a in 128 x 128 tiles (no configuration takes that)
  bool b_tile;    // b in 128 x 128 tiles (else 1 x 128 blocks)
  bool out_bf16;  // else float32
};

// A compiled configuration: its name (as benchmarks and the selection table call it),
// the GEMMs it computes, and its entry points.
struct CutlassConfig {
  const char* name;
  bool b_tile, out_bf16;
  int tile_m;  // rows of one CTA tile (the alignment of M it prefers, not needs)
  // Once per device before the first run (and before any stream capture): function
  // attributes and the persistent grid's size. 0 or a cudaError_t.
  int (*prepare)(int32_t device);
  // Enqueues the batch; 0, or a cudaError_t, or -1 when CUTLASS cannot implement it.
  int (*run)(const CutlassGemm& g, int32_t device, void* workspace, size_t workspace_bytes,
             cudaStream_t stream);
};

// The compiled configurations (none without CUTLASS).
int CutlassConfigCount();
const CutlassConfig& CutlassConfigAt(int i);

// Whether configuration i computes this GEMM: E4M3 operands, a in 1 x 128 blocks, its block
// modes and output type, K % 16 == 0, N a multiple of 16 bytes of output, and 16-byte
// aligned operands, output and a's scales (align: a, b, out, a_scale, b_scale as in
// block_gemm_cublaslt.h's Alignment).
bool CutlassTakes(int i, const CutlassGemm& g, bool e4m3_operands, const uint32_t (&align)[5]);

// The configuration the measured table picks for this GEMM, or -1 where cuBLASLt is the
// faster (see docs/benchmarks.md, "Block-scaled GEMM kernels").
int CutlassPick(const CutlassGemm& g, bool e4m3_operands, const uint32_t (&align)[5]);

}  // namespace jax_fp8
