#!/usr/bin/env bash
# Device call A (ninth session): the fp8 FMA GEMV reading int32 words converted by cvt asm
# (gemv._fp8_sums): its GPU tests at the real shapes, the per-linear A/B against w8a16 and the
# bf16 GEMV at one row, and the fp8 decode micro with SALASERVE_FP8_DECODE=gemv.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py \
  -k "fp8_fma_gemv or fp8_gemv_calibration or fp8_silu" 2>&1 | tee "$OUT/gpu_fp8_gemv_tests.log" | tail -4
timeout 220 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-gemv-ab.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/fp8-gemv-ab.log" | tail -22
SALASERVE_FP8_DECODE=gemv timeout 170 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 \
  --batches 1 --prefill "" --json "$OUT/micro-fp8-gemv.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/micro-fp8-gemv.log" | tail -4
# same-call references: fp8 with the default w8a16 decode kernel, and bf16
timeout 120 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-fp8-w8a16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-fp8-w8a16.log" | tail -2
timeout 100 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-bf16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-bf16.log" | tail -2
