#!/usr/bin/env bash
# Device call A (tenth session): the fp8 tensor-core GEMV (gemv.FP8_DOT_CONFIGS) runs on a GPU for
# the first time: its GPU parity test, the per-linear A/B (with and without PDL), and fp8 decode at
# batch 1 (4K) with and without SALASERVE_FP8_DOT=1 in the same call.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py -k "fp8_fma" \
  2>&1 | tee "$OUT/gpu_fp8_fma_tests.log" | tail -3
timeout 200 python3 scripts/fp8_gemv_ab.py "$OUT/fp8_ab.json" 2>&1 | grep -v -i warn | tee "$OUT/fp8_ab.log" | tail -24
for dot in 0 1; do
  SALASERVE_FP8_DOT=$dot timeout 110 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 \
    --prefill "" --json "$OUT/micro-fp8-dot$dot.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-fp8-dot$dot.log" | tail -1
done
