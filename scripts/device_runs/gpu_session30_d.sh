#!/usr/bin/env bash
# RUN and REVERTED (runs 160-161): DECODE_FP8_SCALES_FIRST no longer exists; this script ran at commits 1c76362 / 739f161.
# Thirtieth session, call D: fp8 pages' V scale loaded one page ahead in the decode split kernel
# (attention.DECODE_FP8_SCALES_FIRST). GPU test first (its decode kind asserts the switch changes no bit), then
# the A/B at 131080 tokens, batches 1 and 8, and fp8 against bf16 pages at batch 1 with the switch on.
# Prediction (docs/perf-notes.md, thirtieth session): b1 -0.002..-0.005 ms, b8 smaller; the kv gap +0.015 shrinks
# by as much.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py -k "decode" 2>&1 | tee "$OUT/gpu-test.log" | grep -E "passed|failed|Error|decode f16" | tail -8
PROFILE_TIMEOUT=170 profile_graph ab-scales-b1 --batch 1 --context 131080 --kv-cache-dtype fp8_e4m3 \
  --ab salaserve.kernels.attention:DECODE_FP8_SCALES_FIRST=0,1 --rounds 7
PROFILE_TIMEOUT=150 profile_graph ab-kv-b1 --batch 1 --context 131080 --ab-kv-cache --rounds 7
PROFILE_TIMEOUT=150 profile_graph ab-scales-b8 --batch 8 --context 131080 --kv-cache-dtype fp8_e4m3 \
  --ab salaserve.kernels.attention:DECODE_FP8_SCALES_FIRST=0,1 --rounds 5
