#!/usr/bin/env bash
# The checks a maintainer runs on a CUDA machine, by section, logs and results under one
# directory. Runs from anywhere (it cds to the repository root); every section runs even
# when an earlier one failed; the exit status is 1 if any failed.
#
#   bash scripts/gpu_checks.sh [--out DIR] [SECTION ...]
#
# Sections (default: all but bench-train-fresh, in this order):
#   build              pip install --no-build-isolation --no-deps . (jax_fp8 with its CUDA
#                      kernels); leave it out to use the jax_fp8 already installed
#   tests              pytest -v tests (GPU tests included; PYTEST_ARGS adds flags, e.g.
#                      "-n 4" with pytest-xdist)
#   sanitize           compute-sanitizer memcheck/racecheck/initcheck/synccheck on jax_fp8's
#                      kernels (scripts/sanitize.sh); skipped without compute-sanitizer
#   bench-update       bench/bench_update.py, N up to 4608, L = 16 and 1024
#   bench-train        bench/bench_train_step.py, 3 sizes x 4 variants (~8 min on one H200)
#   bench-train-fresh  bench/bench_train_step.py --compile-fresh --compile-only (cold
#                      compile time of every variant, each in a new process)
#   bench-layout       bench/bench_layout_kernels.py
#   multigpu           bench/bench_multigpu.py on every local GPU: data-parallel, FSDP and
#                      tensor-parallel steps of bf16, Flax FP8 and jax_fp8, into
#                      DIR/bench_multigpu (NVLink multicast off: NCCL_NVLS_ENABLE=0);
#                      skipped on one GPU
#
# DIR defaults to out/gpu_checks in the repository (OUT=DIR works too). Extra flags for a benchmark:
# BENCH_UPDATE_ARGS, BENCH_TRAIN_ARGS, BENCH_LAYOUT_ARGS, BENCH_MULTIGPU_ARGS.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out/gpu_checks}
if [ "${1:-}" = "--out" ]; then OUT=$2; shift 2; fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
ALL="build tests sanitize bench-update bench-train bench-layout multigpu"
[ $# -gt 0 ] || set -- $ALL
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
declare -A STATUS=()
FAILED=0

gpu_count() { $PY -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null || echo 0; }

run_section() {  # name, command...: the command's output to OUT/name.log, its tail shown
  local name=$1; shift
  local log="$OUT/$name.log"
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  tail -n "${TAIL_LINES:-25}" "$log"
  if [ $rc -eq 0 ]; then STATUS[$name]="ok ($((SECONDS - t0)) s)"
  elif [ $rc -eq 99 ]; then STATUS[$name]="skipped: $(tail -n 1 "$log")"
  else STATUS[$name]="FAILED (exit $rc, $((SECONDS - t0)) s; $log)"; FAILED=1
  fi
  echo "=== $name: ${STATUS[$name]}"
}

environment() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  $PY -c "import jax_fp8; print('jax_fp8', jax_fp8.__version__, 'CUDA kernel:', jax_fp8.HAS_CUDA_KERNEL)" \
    2>/dev/null || echo "jax_fp8 not installed yet"
  git rev-parse --short HEAD 2>/dev/null
}

build() {
  $PY -m pip install --no-build-isolation --no-deps . || return 1
  (cd /tmp && $PY -c "import jax_fp8; assert jax_fp8.HAS_CUDA_KERNEL, 'built without its CUDA kernel'; print('CUDA kernel loaded')")
}

# One line per test (-v) in the log, so that a run cut short still names what failed;
# junit XML and the slowest tests when it ends.
tests() { XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -v -rfEs --durations=25 \
            --junitxml "$OUT/tests.xml" ${PYTEST_ARGS:-} tests; }

sanitize() {
  command -v compute-sanitizer >/dev/null || { echo "no compute-sanitizer on PATH"; return 99; }
  bash scripts/sanitize.sh "$OUT/sanitize"
}

multigpu() {
  local n; n=$(gpu_count)
  [ "$n" -gt 1 ] || { echo "one GPU ($n): no multi-GPU run"; return 99; }
  NCCL_NVLS_ENABLE=0 $PY bench/bench_multigpu.py \
    --outdir "$OUT/bench_multigpu" ${BENCH_MULTIGPU_ARGS:-}
}

environment 2>&1 | tee "$OUT/environment.txt"
for section in "$@"; do
  case $section in
    build) run_section build build ;;
    tests) run_section tests tests ;;
    sanitize) run_section sanitize sanitize ;;
    bench-update) run_section bench-update $PY bench/bench_update.py --per-tensor-max-n 1152 \
                    --outdir "$OUT/bench_update" ${BENCH_UPDATE_ARGS:-} ;;
    bench-train) run_section bench-train $PY bench/bench_train_step.py \
                   --outdir "$OUT/bench_train_step" ${BENCH_TRAIN_ARGS:-} ;;
    bench-train-fresh) run_section bench-train-fresh $PY bench/bench_train_step.py --compile-fresh \
                         --compile-only --outdir "$OUT/bench_train_step_fresh" ${BENCH_TRAIN_ARGS:-} ;;
    bench-layout) run_section bench-layout $PY bench/bench_layout_kernels.py \
                    --json "$OUT/bench_layout_kernels.json" ${BENCH_LAYOUT_ARGS:-} ;;
    multigpu) run_section multigpu multigpu ;;
    *) echo "unknown section '$section' (sections: $ALL bench-train-fresh)"; STATUS[$section]="unknown"; FAILED=1 ;;
  esac
done
echo
echo "=== summary ($OUT)"
for section in "$@"; do printf '  %-18s %s\n' "$section" "${STATUS[$section]:-not run}"; done | tee "$OUT/summary.txt"
exit $FAILED
