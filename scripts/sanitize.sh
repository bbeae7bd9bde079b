#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, initcheck, synccheck) on jax_fp8's CUDA
# kernel, through the real JAX path (scripts/sanitize_driver.py). Only our kernel is
# instrumented (XLA's own kernels are filtered out). Needs a GPU and the package
# installed with its CUDA kernel.   bash scripts/sanitize.sh [OUTDIR]
set -u
out=${1:-.}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  echo "== $tool"
  XLA_PYTHON_CLIENT_PREALLOCATE=false compute-sanitizer --tool "$tool" \
    --kernel-name kns=UpdateKernel --error-exitcode 3 \
    python3 "$here/sanitize_driver.py" > "$out/sanitize_$tool.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|wide-span|sanitize driver done" "$out/sanitize_$tool.log"
  [ $rc -eq 0 ] || { echo "$tool: exit $rc"; tail -20 "$out/sanitize_$tool.log"; status=1; }
done
exit $status
