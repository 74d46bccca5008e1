#!/usr/bin/env bash
# Twenty-ninth session, NOT RUN (device time spent; superseded by gpu_session30_a.sh and _b.sh, runs 157-158): fp8 against bf16 KV pages under this session's defaults
# (the sparse prefill's staged copy, SPARSE_FP8_STAGED; the two-wave decode split rule).
# 1. `--ab-kv-cache` at 131080 tokens, batches 1 and 32 (one process each): the issue's "decode at 128K no slower".
# 2. micro's 32K prefill per page format (the benchmark number; run 8 had 1.42 s against 1.31).
# Prediction (docs/perf-notes.md, twenty-ninth session): batch 1 fp8 - bf16 +0.010..+0.020 ms (the new split
# rule helped bf16 pages more in run 153); batch 32 -0.4..-0.8%; the 32K prefill on fp8 pages within 2% of bf16.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
PROFILE_TIMEOUT=200 profile_graph ab-kv-b1 --batch 1 --context 131080 --ab-kv-cache --rounds 7
PROFILE_TIMEOUT=280 profile_graph ab-kv-b32 --batch 32 --context 131080 --ab-kv-cache --rounds 5
for kv in auto fp8_e4m3; do
  timeout 150 python3 -m salaserve.bench.micro --kv-cache-dtype $kv --contexts 4096 --batches 1 --prefill 32768 --max-kv-gib 30 \
    --json "$OUT/micro-prefill-kv-$kv.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-prefill-kv-$kv.log" | tail -4
done
