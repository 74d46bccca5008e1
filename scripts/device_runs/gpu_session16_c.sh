#!/usr/bin/env bash
# Sixteenth session, second device call: the fp8 mma GEMV with W two chunks ahead and a one-tile
# config. Per-linear A/B at M = 1 and 8, fp8 decode at 4K (batches 1, 8) and bf16 in the same call,
# then the GPU engine test of the fp8 decode path (graph vs eager, refactored onto graph_vs_eager).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 170 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-ab.json" 1 8 2>&1 | grep -v -i warn | tee "$OUT/fp8-ab.log" \
  | grep -v "^           [a-z]*:\|^           fma n\|^           mma n" | tail -34
decode_4k fp8 150 4 --quantization fp8
decode_4k bf16 100 3
timeout 150 $GPU_PYTEST tests/test_gpu_engine.py tests/test_gpu_quant.py -k "fp8_decode_kernels or fp8_mma" 2>&1 \
  | tee "$OUT/tests.log" | grep -E "rel err|passed|failed|Error|assert" | tail -8
