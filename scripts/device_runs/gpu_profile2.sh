#!/usr/bin/env bash
# One device call: host time of the batch build (staged vs per-field), then graph-replay kernel
# profiles of the decode step at batch 1 (4K, 128K) and batch 128 (2K) with PDL across the chain.
# Timeouts $1 (each profile). Logs and JSON in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 60 python3 scripts/build_ab.py 2>&1 | grep -v -i warn | tee "$OUT/build-ab.log"
timeout "${1:-150}" python3 -m salaserve.bench.profile_step --graph --context 4096,131072 --top 14 \
  --json "$OUT/graph-profile-b1.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-b1.log" | tail -50
timeout "${1:-150}" python3 -m salaserve.bench.profile_step --graph --batch 128 --context 2048 --top 16 \
  --json "$OUT/graph-profile-b128.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-b128.log" | tail -30
