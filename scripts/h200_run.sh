#!/usr/bin/env bash
# The H200 (device tool) checks, by section, results under $OUT. Build first (kept on
# a warm machine), then any of: kernel tests bench e2e e2e_small sanitize scale transpose
# multigpu (the last on nvidia-h200-x2 / -x4). SANITIZE_TARGETS="update transpose" picks
# the kernels sanitize.sh instruments.
#   bash scripts/h200_run.sh kernel tests bench      # one device call (~8 min)
#   bash scripts/h200_run.sh e2e sanitize            # a second one
#   bash scripts/h200_run.sh tests scale             # issue 6: CUDA-graph test, 5,000 / 50,000 states
#   E2E_SIZES=1024x1024 bash scripts/h200_run.sh e2e # the small train-step size
#   E2E_ARGS='--blocks 4 --save-hlo --top-kernels 1000' ...  # extra bench_train_step flags
#   PROBE_BLOCKS=24 PROBE_VARIANTS=jax_fp8 PROBE_NAMES='base weight_amax_fwd_barrier' ... probe
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
quiet() { grep -v "^WARNING\|^I0000\|^E0000"; }
nvidia-smi --query-gpu=name,driver_version --format=csv
# SKIP_INSTALL=1 reuses the package installed by an earlier call on a warm machine.
if [ "${SKIP_INSTALL:-0}" != 1 ] || ! python3 -c "import jax_fp8" 2>/dev/null; then
  python3 -m pip install --no-build-isolation --no-deps . >"$OUT/install.log" 2>&1 \
    || { tail -30 "$OUT/install.log"; exit 1; }
fi
(cd /tmp && python3 -c "import jax, jax_fp8; print(jax.__version__, jax.devices(), 'CUDA kernel:', jax_fp8.HAS_CUDA_KERNEL)" 2>&1 | tail -1)
[ $# -gt 0 ] || set -- kernel tests bench
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/xla_autotune"
# XLA's GEMM autotuning results from an earlier call (run with carry:
# [".xla_autotune.tgz"]): an FP8 train step then compiles in seconds instead of ~85 s.
# Written back to $OUT at the end (one archive: the device tool returns few files).
[ -f .xla_autotune.tgz ] && tar xzf .xla_autotune.tgz -C /tmp
for section in "$@"; do
  echo "=== $section"
  case $section in
    kernel) timeout 150 python3 scripts/kernel_check.py --skip-bits 2>&1 | quiet | tee "$OUT/kernel.log" ;;
    # 5,000 separate states (one custom call, 4 launches), and 50,000 tensors as 1,400
    # stacked states (50,000 separate arrays would not compile in reasonable time).
    scale) timeout "${SCALE_LIMIT:-400}" python3 scripts/kernel_check.py --skip-bits --only-scale --scale 5000 \
             --scale-groups 50000:1400 2>&1 | quiet | tee "$OUT/scale.log" ;;
    tests_from) # TESTS_FROM=file of node ids: the part of the suite a cut-off run missed
           (cd tests && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rs \
              $(sed 's|^tests/||' "../$TESTS_FROM") 2>&1 | tail -40) | tee "$OUT/pytest_rest.log" ;;
    # pytest-xdist is on the device image: 8 workers, each growing its GPU memory on
    # demand (8 preallocating processes would not fit). One process alone took > 190 s.
    tests) (cd tests && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-240}" \
              python3 -m pytest -q -p no:cacheprovider -rfEs $(python3 -c "import xdist" \
              2>/dev/null && printf "%s" "-n 8") . 2>&1 | tail -40) | tee "$OUT/pytest.log" ;;
    bench) timeout $(( ${BENCH_LIMIT:-150} + 70 )) python3 bench/bench_update.py --lengths 1024,16 --per-tensor-max-n 1152 \
             --time-limit "${BENCH_LIMIT:-150}" --outdir "$OUT/bench" > "$OUT/bench.log" 2>&1
           tail -60 "$OUT/bench/results.md" 2>/dev/null || tail -30 "$OUT/bench.log" ;;
    # (XLA_FLAGS above: later variants reuse the GEMM autotuning of earlier ones.)
    e2e) timeout $(( ${E2E_TIMEOUT:-${E2E_LIMIT:-200}} + 35 )) python3 bench/bench_train_step.py \
           --sizes "${E2E_SIZES:-2048x4096}" --variants "${E2E_VARIANTS:-bf16,flax_fp8,flax_fp8_noupdate,jax_fp8,jax_fp8_noupdate,jax_fp8_packed,jax_fp8_packed_noupdate}" \
           $([ "${E2E_LIMIT:-200}" = 0 ] || echo --time-limit "${E2E_LIMIT:-200}") ${E2E_ARGS:-} \
           --outdir "$OUT/e2e" 2>&1 | tail -60 ;;
    # The FP8 byte-transpose kernel: its tests (bits == lax.transpose) and its benchmark.
    transpose) (cd tests && timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs test_transpose.py 2>&1 | tail -5) | tee "$OUT/pytest_transpose.log"
           timeout 120 python3 bench/bench_transpose.py --json "$OUT/transpose.json" 2>&1 | quiet | tee "$OUT/transpose.md" ;;
    graph) timeout 120 python3 scripts/cuda_graph_check.py 2>&1 | quiet | tee "$OUT/graph.log" ;;
    probe) timeout "${PROBE_LIMIT:-400}" python3 scripts/fusion_probe.py "$OUT/probe" ${PROBE_NAMES:-} 2>&1 | grep "PROBE\|Error" ;;
    e2e_small) timeout 235 python3 bench/bench_train_step.py --small --time-limit 200 \
           --outdir "$OUT/e2e_small" 2>&1 | tail -40 ;;
    multigpu) NCCL_NVLS_ENABLE=0 timeout "${MULTIGPU_LIMIT:-300}" python3 scripts/multigpu_dp.py --trace 2>&1 | quiet | tee "$OUT/multigpu.log" ;;
    sanitize) timeout "${SANITIZE_LIMIT:-400}" bash scripts/sanitize.sh "$OUT/sanitize" ;;
    *) echo "unknown section $section" ;;
  esac
done
[ -d /tmp/xla_autotune ] && tar czf "$OUT/xla_autotune.tgz" -C /tmp xla_autotune
true
