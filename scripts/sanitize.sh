#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) on jax_fp8's CUDA
# kernels (the update and the FP8 transposes), through the real JAX path
# (scripts/sanitize_driver.py). Only jax_fp8's kernels are instrumented (XLA's own are
# filtered out). Needs a GPU, compute-sanitizer and jax_fp8 installed with its CUDA
# kernels; scripts/gpu_checks.sh runs it as its "sanitize" section.
#   bash scripts/sanitize.sh [OUTDIR]     (SANITIZE_TARGETS, SANITIZE_TOOLS pick a subset)
set -u
out=${1:-.}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
status=0
# SANITIZE_TARGETS: "update" (UpdateKernel) and/or "transpose" (TransposeBytesKernel,
# QuantizeTransposeKernel).
for target in ${SANITIZE_TARGETS:-update transpose}; do
  case $target in
    update) kernel=UpdateKernel; log_suffix="" ;;
    transpose) kernel=Transpose; log_suffix=_transpose ;;  # both transpose kernels
    *) echo "unknown target $target"; exit 2 ;;
  esac
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    echo "== $target: $tool"
    log="$out/sanitize_$tool$log_suffix.log"
    XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool "$tool" \
      --kernel-name kns=$kernel --error-exitcode 3 \
      python3 "$here/sanitize_driver.py" "$target" > "$log" 2>&1
    rc=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|wide-span|sanitize driver done" "$log"
    [ $rc -eq 0 ] || { echo "$tool: exit $rc"; tail -20 "$log"; status=1; }
  done
done
exit $status
