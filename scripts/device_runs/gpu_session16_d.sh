#!/usr/bin/env bash
# Sixteenth session, last device call: the fp8 mma GEMV with W three chunks ahead. Per-linear A/B
# at M = 1, fp8 decode at 4K (batches 1, 8), bf16 in the same call for the ratio.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 130 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-ab.json" 1 2>&1 | grep -v -i warn | tee "$OUT/fp8-ab.log" \
  | grep -v "^           [a-z]*:\|^           fma n\|^           mma n" | tail -26
decode_4k fp8 130 4 --quantization fp8
decode_4k bf16 90 3
