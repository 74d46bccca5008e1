#!/usr/bin/env bash
# Seventeenth session, third device call: the stream GEMV's L2 prefetch, one piece per thread,
# against none (per-linear A/B at M = 1), then fp8 (no prefetch) and bf16 decode at 4K.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
ab() {  # ab LABEL: the A/B table's summary lines
  timeout 150 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-ab-$1.json" 1 2>&1 | grep -v -i warn | tee "$OUT/fp8-ab-$1.log" \
    | grep -v "^           [a-z]*:\|^           fma n\|^           stream n" | tail -26
}
SALASERVE_FP8_PREFETCH=0 ab noprefetch
SALASERVE_FP8_PREFETCH=1 FP8_AB_KINDS=stream ab prefetch
decode_4k fp8 150 4 --quantization fp8
decode_4k bf16 90 3
