"""The FP8 GEMMs and the grouped GEMMs, each with its custom VJP, whose public names
`jax_fp8` exports: `fp8_dot_general` (`dot_general`), `fp8_einsum` (`einsum`), the frame
of the recipes without state (`scaled_dot`), the three products of one GEMM (`_gemms`),
the AD plumbing they share (`_ad`), and a mixture-of-experts layer's grouped GEMMs:
`fp8_ragged_dot` (`ragged_fp8`, `_grouped`) and `ragged_dot` without FP8 (`ragged`)."""
