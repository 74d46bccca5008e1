#!/usr/bin/env bash
# Twenty-seventh session: fp8 against bf16 KV pages at 128K in ONE process (profile_step --ab-kv-cache: a second
# pool of the other format on the same pages and contents, graphs per pool, rounds interleaved). Runs 141-143 and
# 144 compared separate processes, whose spread (~0.02-0.05 ms) is as large as the difference. bf16 weights,
# batch 1, with the fp16-dots decode (DECODE_FP8_F16_DOTS, now on by default; run 144: 4.973 -> 4.970 ms).
# Prediction: at 131080 (the common step) fp8 within +-0.005 ms of bf16; at 131072 (page start: the fp8 store
# sets the page scale) and 131103 (a C1 window closes) +0.005 to +0.02.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py 2>&1 | grep -E "f16_dots|passed|failed|Error" | tail -8
PROFILE_TIMEOUT=540 profile_graph ab-kv-128k --context 131080,131072,131103 --ab-kv-cache --rounds 7
grep -E "median" "$OUT/ab-kv-128k.log"
