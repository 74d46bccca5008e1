#!/usr/bin/env bash
# Twenty-sixth session, NOT RUN (device time spent): fp16 dot operands in the decode attention on fp8 KV pages
# (attention.DECODE_FP8_F16_DOTS, SALASERVE_FP8_KV_F16_DOTS). Run 143: fp8 pages 4.993 against bf16 pages
# 4.971 ms at 131080 tokens (bf16 weights, batch 1, graph, PDL on), most of the gap in the decode split
# kernel. Prediction (docs/perf-notes.md, twenty-sixth session): 4.993 -> ~4.980-4.985 ms, fp8 pages then
# within ~0.01 ms of bf16 pages. GPU tests first (the decode kind checks both settings against dequantized
# pages), then the A/B in one process, then bf16 pages in a process of their own for the reference.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py 2>&1 | grep -E "f16_dots|compress|passed|failed|Error" | tail -12
profile_graph ab-f16-131080 --context 131080 --kv-cache-dtype fp8_e4m3 --ab salaserve.kernels.attention:DECODE_FP8_F16_DOTS=0,1 --rounds 7
profile_graph bf16-131080 --context 131080
profile_graph ab-f16-4096 --context 4096 --kv-cache-dtype fp8_e4m3 --ab salaserve.kernels.attention:DECODE_FP8_F16_DOTS=0,1 --rounds 5
