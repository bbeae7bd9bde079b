#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) on jax_fp8's CUDA
# kernels (the update and the FP8 transpose), through the real JAX path
# (scripts/sanitize_driver.py). Only our kernel is
# instrumented (XLA's own kernels are filtered out). Needs a GPU and the package
# installed with its CUDA kernel.   bash scripts/sanitize.sh [OUTDIR]
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
