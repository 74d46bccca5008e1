#!/usr/bin/env bash
# Device call D (ninth session): the fp8 GEMV walking column pairs (x shared by two rows):
# its GPU tests, the per-linear A/B at one row, the fp8 micro (default path) and bf16 at batch 1.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py \
  -k "fp8_fma_gemv or fp8_gemv_calibration or fp8_silu" 2>&1 | tee "$OUT/gpu_fp8_gemv_tests.log" | tail -2
timeout 200 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-gemv-ab.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/fp8-gemv-ab.log" | tail -22
timeout 130 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-fp8.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-fp8.log" | tail -2
timeout 100 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-bf16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-bf16.log" | tail -2
