#!/usr/bin/env bash
# Device call A for the paths prepared off by default (perf notes): every GPU test, the sparse
# prefill attention per tile size, and the fp8 FMA GEMV (SALASERVE_FP8_DECODE=gemv) per linear.
# Timeouts $1 (tests), $2 (each bench). Logs in $OUT. Call B (the micro runs) is
# scripts/device_runs/gpu_prepared_micro.sh.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-260}" python3 -m pytest -m gpu -q -p no:cacheprovider tests -rfE --durations=8 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -14
timeout "${2:-100}" python3 -m salaserve.kernels.bench_sparse --prefill-only 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-sparse.log" | tail -8
SALASERVE_FP8_DECODE=gemv timeout "${2:-100}" python3 -m salaserve.kernels.bench_quant --m 1 8 --no-prefill \
  --json "$OUT/bench-quant-fp8gemv.json" 2>&1 | grep -v -i warn | tee "$OUT/bench-quant-fp8gemv.log" | grep -v "^  " | tail -12
