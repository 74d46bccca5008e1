#!/usr/bin/env bash
# Twenty-ninth session: the decode attention's split count at 128K, batch 1 (attention.DECODE_NUM_SPLITS, an
# override of choose_num_splits for profile_step --ab). Today's rule gives 64 splits for a sparse layer
# (max_decode_blocks 128 / 2 pages), so the ~96 selected pages per KV head land 2 per program on 48 programs
# and 16 programs are empty. 96 splits: one page per program (192 programs, 2 per SM fit); 128: one page each
# and 32 empty. Prediction (docs/perf-notes.md, twenty-ninth session): 96 -0.002..-0.006 ms on the step, 128 no
# better than 96; fp8 pages gain at most a third of their +0.009 ms gap to bf16 pages.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kernels_attention.py -k "paged_decode" 2>&1 | grep -E "passed|failed|Error" | tail -4
PROFILE_TIMEOUT=280 profile_graph ab-splits-fp8 --batch 1 --context 131080 --kv-cache-dtype fp8_e4m3 \
  --ab salaserve.kernels.attention:DECODE_NUM_SPLITS=0,96,128 --rounds 7
PROFILE_TIMEOUT=280 profile_graph ab-splits-bf16 --batch 1 --context 131080 \
  --ab salaserve.kernels.attention:DECODE_NUM_SPLITS=0,96,128 --rounds 7
