#!/usr/bin/env bash
# Sixteenth session, first device call: the fp8 mma.sync GEMV (quant_gemm/fp8_mma.py). Its GPU
# tests and the fp8 GEMV tests, the per-linear A/B at M = 1 and 8 against the FMA GEMV and w8a16,
# then fp8 decode at 4K (batches 1 and 8; start-up calibrates the mma configs) and bf16 in the
# same call for the ratio.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 $GPU_PYTEST tests/test_gpu_quant.py -k "fp8_mma or fp8_fma_gemv_every or fp8_gemv_calibration" 2>&1 \
  | tee "$OUT/tests.log" | grep -E "passed|failed|Error|assert" | tail -8
timeout 170 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-ab.json" 1 8 2>&1 | grep -v -i warn | tee "$OUT/fp8-ab.log" \
  | grep -v "^           [a-z]*:\|^           mma\|^           fma" | tail -30
decode_4k fp8 150 4 --quantization fp8
decode_4k bf16 100 3
