#!/usr/bin/env bash
# Device call E (eighth session): the final defaults once more (a second batch-1 sample), batch 128
# at 2K, and the 128K prefill without the window kernel (SALASERVE_SPARSE_ATTN_WINDOW=0) against
# the defaults' run-32 timing.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 110 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,131072,524288 --prefill "" \
  --json "$OUT/micro-b1.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-b1.log" | tail -5
timeout 100 python3 -m salaserve.bench.micro --batches 128 --contexts 2048 --prefill "" --max-kv-gib 60 \
  --json "$OUT/micro-b128.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-b128.log" | tail -2
SALASERVE_SPARSE_ATTN_WINDOW=0 timeout 110 python3 -m salaserve.bench.micro --batches 1 --contexts 4096 \
  --prefill 131072 --json "$OUT/micro-window0.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-window0.log" | tail -4
