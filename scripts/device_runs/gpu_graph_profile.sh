#!/usr/bin/env bash
# One device call: the kernel timeline of batch-1 decode graph replays at 4K and 128K (where the
# 128K step's extra time goes, gaps included), then the per-linear quantized-kernel table at M = 1.
# Usage: gpu_graph_profile.sh [profile timeout] [bench_quant timeout] [kv dtype]. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-240}" python3 -m salaserve.bench.profile_step --graph --context 4096,131072 --top 22 \
  --kv-cache-dtype "${3:-auto}" --json "$OUT/graph-profile.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile.log"
[ "${2:-200}" = 0 ] || timeout "${2:-200}" python3 -m salaserve.kernels.bench_quant --m 1 --no-prefill 2>&1 \
  | grep -v -i warn | tee "$OUT/bench-quant-m1.log" | tail -30
