#!/usr/bin/env bash
# One device call: bf16 decode at batch 1 (2K, 4K, 128K) and batch 128 (2K, 4K) after the
# Lightning decode kernel's new block picks. Timeout $1. Log and JSON in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-170}" python3 -m salaserve.bench.micro --contexts 2048,4096,131072 --batches 1,128 --prefill 8192 \
  --max-kv-gib 40 --json "$OUT/micro-bf16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-bf16.log" | tail -10
