#!/usr/bin/env bash
# Everything the H200 (device tool) checks in one call: build, kernel timings, the full
# test suite with the GPU tests running, the benchmark. Results go under $OUT.
#   bash scripts/h200_run.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/install.log"
python3 -m pip install --no-build-isolation --no-deps . >>"$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import jax, jax_fp8; print(jax.__version__, jax.devices(), jax_fp8.HAS_CUDA_KERNEL)" 2>&1 | tail -1
timeout 120 python3 scripts/kernel_check.py --skip-bits 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tee "$OUT/kernel.log"
(cd tests && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rs . 2>&1 | tail -40) | tee "$OUT/pytest.log"
timeout "${BENCH_TIMEOUT:-220}" python3 bench/bench_update.py --lengths 1024,16 --per-tensor-max-n 1152 \
  --time-limit 150 --outdir "$OUT/bench" > "$OUT/bench.log" 2>&1
tail -60 "$OUT/bench/results.md" 2>/dev/null || tail -30 "$OUT/bench.log"
