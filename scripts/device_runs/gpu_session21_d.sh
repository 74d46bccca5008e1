#!/usr/bin/env bash
# Twenty-first session, call D: the start-up calibration's Triton compiles in parallel threads
# (kernels/compile_ahead.py). With an empty Triton cache and plans off, the wall time of
# `profile_step --graph --quantization w4a16` (load, quantize, calibrate every M bucket 1-16, warm-up,
# capture, one replay) with SALASERVE_PARALLEL_COMPILE on; then the GPU tests of the calibrations
# that now precompile. Call E: the same start-up with it off. Prediction: the compiles are most of
# a cold start-up (run 100: 355 s), and 16 cores take them ~5-8x faster: ~100-150 s on, ~300 s off.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
cold_startup() {
  local label=$1 limit=$2
  shift 2
  rm -rf /tmp/tc-$label && mkdir -p /tmp/tc-$label
  local t0=$SECONDS
  TRITON_CACHE_DIR=/tmp/tc-$label timeout "$limit" python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 3 "$@" 2>&1 | grep -v -i warn | tee "$OUT/startup-$label.log" | head -5
  echo "cold start-up + one profiled replay, $label: $((SECONDS - t0)) s (nproc $(nproc))" | tee -a "$OUT/startup-$label.log"
}
cold_startup ${1:-parallel} ${2:-280}
if [ "${1:-parallel}" = parallel ]; then
  TRITON_CACHE_DIR=/tmp/tc-parallel timeout 260 $GPU_PYTEST tests/test_gpu_quant.py \
    -k "precompile or calibration" 2>&1 | tail -8 | tee "$OUT/pytest-calibration.log"
fi
