#!/usr/bin/env bash
# Twelfth session, second call: what bounds the per-token sparse attention (random vs shared
# block lists), then the 128K prefill's chunk size x GLA input precision in one process.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export TRITON_CACHE_DIR=$PWD/.triton-cache
timeout 120 python3 scripts/sparse_attn_bound.py 2>&1 | tee "$OUT/sparse_attn_bound.log" | grep -v -i warn | tail -6
timeout 330 python3 scripts/prefill_ab.py --reps 3 --json "$OUT/prefill_ab.json" 2>&1 | tee "$OUT/prefill_ab.log" \
  | grep -v -i warn | tail -8
