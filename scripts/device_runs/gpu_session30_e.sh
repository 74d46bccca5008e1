#!/usr/bin/env bash
# RUN and REVERTED (runs 160-161): DECODE_FP8_SCALES_FIRST no longer exists; this script ran at commits 1c76362 / 739f161.
# Thirtieth session, call E: V's page scales one page ahead (attention._scales_first) at batch 32, 131080 tokens,
# fp8 pages, in one process; the GPU test's decode kind first (the kernel path bit-equal with and without).
# Prediction (docs/perf-notes.md): -0.2..-0.6% on the step.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py -k "decode" 2>&1 | tee "$OUT/gpu-test.log" | grep -E "passed|failed|Error" | tail -4
PROFILE_TIMEOUT=220 profile_graph ab-scales-b32 --batch 32 --context 131080 --kv-cache-dtype fp8_e4m3 \
  --ab salaserve.kernels.attention:DECODE_FP8_SCALES_FIRST=0,1 --rounds 5
