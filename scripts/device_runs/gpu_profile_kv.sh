#!/usr/bin/env bash
# One device call: per-kernel profile of a batch-1 decode step at 4K with fp8 and bf16 KV pages.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for kv in fp8_e4m3 auto; do
  timeout "${1:-90}" python3 -m salaserve.bench.profile_step --context 4096 --kv-cache-dtype $kv --top 14 \
    --json "$OUT/profile-kv-$kv.json" 2>&1 | grep -v -i warn | tail -16
done
