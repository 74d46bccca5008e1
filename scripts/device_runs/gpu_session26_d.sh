#!/usr/bin/env bash
# RUN (143). COMPRESS_HEAD_SCALES was removed afterwards (the flat form slower): to run again, check out f300170.
# Twenty-sixth session: run 142 put fp8 KV pages 0.08 ms behind bf16 pages at 131103 tokens (5.128 / 5.131
# against 5.048 / 5.050 ms), where every step closes a C1 compression window (131104 = 16 * 8194) and
# update_compressed runs: its fp8 form gathered a page scale per element (256 per token). The change
# (attention.COMPRESS_HEAD_SCALES) loads one per (token, KV head). Prediction: most of the gap at 131103
# closes (the kernel's excess under PDL looked ~9 us per layer), so fp8 at 131103 ~5.06-5.08 ms. Then where
# the rest goes: a step that neither starts a page nor closes a window (131080), and PDL-off kernel times.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py 2>&1 | grep -E "compress|decode |prefill:|passed|failed|Error" | tail -12
profile_graph ab-fp8-131103 --context 131103 --kv-cache-dtype fp8_e4m3 --ab salaserve.kernels.attention:COMPRESS_HEAD_SCALES=0,1 --rounds 5
profile_graph bf16-131103 --context 131103
profile_graph bf16-131080 --context 131080
profile_graph fp8-131080 --context 131080 --kv-cache-dtype fp8_e4m3
profile_graph nopdl-bf16-131103 --context 131103 --no-pdl
profile_graph nopdl-fp8-131103 --context 131103 --kv-cache-dtype fp8_e4m3 --no-pdl
