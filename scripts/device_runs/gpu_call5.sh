#!/usr/bin/env bash
# One device call: batch build host time (pinned ring), the Lightning decode kernel's
# (block_v, warps) sweep at batch 1 and 128, fp8 decode with w8a16 back on plain launches, and
# the kernel profile of a 128K-token prefill. Logs and JSON in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 60 python3 scripts/build_ab.py 2>&1 | grep -v -i warn | tee "$OUT/build-ab.log"
timeout 100 python3 -m salaserve.kernels.bench_lightning --batch 1 128 --layers 24 --sweep 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-lightning.log" | head -8
timeout 100 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 --prefill 8192 \
  --max-kv-gib 20 --json "$OUT/micro-fp8.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-fp8.log" | tail -5
timeout 150 python3 -m salaserve.bench.profile_step --prefill 131072 --top 22 --json "$OUT/prefill-profile-128k.json" \
  2>&1 | grep -v -i warn | tee "$OUT/prefill-profile-128k.log" | tail -26
