#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) on jax_fp8's CUDA
# kernels (the update, the FP8 transposes, block quantization, the block-scaled GEMM, the
# packed state's split, the grouped GEMM and its weight gradient), through the real JAX path
# (scripts/sanitize_driver.py). Only jax_fp8's kernels are instrumented (XLA's own are
# filtered out). Needs a GPU, compute-sanitizer and jax_fp8 installed with its CUDA
# kernels; scripts/gpu_checks.sh runs it as its "sanitize" section.
#   bash scripts/sanitize.sh [OUTDIR]     (SANITIZE_TARGETS, SANITIZE_TOOLS pick a subset)
set -u
out=${1:-.}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
status=0
# SANITIZE_TARGETS: "update" (UpdateKernel), "transpose" (TransposeBytesKernel,
# QuantizeTransposeKernel), "block" (BlockQuantizeKernel, BlockGemmFallbackKernel),
# "block_all" (memcheck of every kernel the block driver runs: cuBLASLt's block-scaled GEMM
# kernels reading and writing the buffers our handler passes them), "split"
# (SplitRowsKernel: a packed state's scale vectors cut into one buffer per state), "grouped"
# (GroupedGemmSetupKernel, GroupedGemmZeroKernel, GroupedWgradSetupKernel), "ragged"
# (RaggedDotSetupKernel, RaggedDotZeroEmptyKernel: the bf16 grouped GEMM's) and "grouped_all"
# (memcheck of every kernel the grouped driver runs: CUTLASS's grouped GEMM on the arrays the
# setup kernels write, for the forward / input gradient and the weight gradient).
for target in ${SANITIZE_TARGETS:-update transpose block block_all split grouped ragged grouped_all}; do
  tools=${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}
  case $target in
    update) filter=(--kernel-name kns=UpdateKernel); driver=update; log_suffix="" ;;
    transpose) filter=(--kernel-name kns=Transpose); driver=transpose; log_suffix=_transpose ;;
    block) filter=(--kernel-name kns=Block); driver=block_kernels; log_suffix=_block ;;
    block_all) filter=(); driver=block; log_suffix=_block_all; tools=memcheck ;;
    split) filter=(--kernel-name kns=SplitRowsKernel); driver=split; log_suffix=_split ;;
    grouped) filter=(--kernel-name kns=Grouped); driver=grouped; log_suffix=_grouped ;;
    ragged) filter=(--kernel-name kns=RaggedDot); driver=grouped; log_suffix=_ragged ;;
    grouped_all) filter=(); driver=grouped; log_suffix=_grouped_all; tools=memcheck ;;
    *) echo "unknown target $target"; exit 2 ;;
  esac
  for tool in $tools; do
    echo "== $target: $tool"
    log="$out/sanitize_$tool$log_suffix.log"
    PYTHONPATH="$here/../tests${PYTHONPATH:+:$PYTHONPATH}" \
    XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool "$tool" \
      "${filter[@]}" --error-exitcode 3 \
      python3 "$here/sanitize_driver.py" "$driver" > "$log" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|wide-span|block (quantize|gemm)|grouped (gemm|wgrad)|ragged dot|sanitize driver done" "$log"
    [ $rc -eq 0 ] || { echo "$tool: exit $rc"; tail -20 "$log"; status=1; }
  done
done
exit $status
