#!/usr/bin/env bash
# Device call C (sixth session): the micro at batch 1 and 128 with the engine-loop columns
# (overlap scheduling on and off) and the large-M tensor-core GEMV in the calibration; the large-M
# GEMV against cuBLAS per shape; then the GPU tests of the kernels and the engine.
# Timeouts: $1 micro, $2 bench_gemv, $3 tests. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-220}" python3 -m salaserve.bench.micro --contexts 2048,4096 --batches 1,128 --prefill "" \
  --max-kv-gib 20 --json "$OUT/micro.json" 2>&1 | grep -v -i warn | tee "$OUT/micro.log" | tail -7
timeout "${2:-80}" python3 -m salaserve.kernels.bench_gemv --m 32 64 128 --no-step 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-gemv-large-m.log" | tail -30
timeout "${3:-230}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_kernels_gemv.py \
  tests/test_gpu_engine.py tests/test_kernels_lightning.py tests/test_kernels_sparse.py tests/test_gpu_quant.py \
  tests/test_kernels_attention.py tests/test_kv_fp8.py tests/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
