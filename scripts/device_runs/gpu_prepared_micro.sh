#!/usr/bin/env bash
# Device call B: the full-size micro with SALASERVE_STAGE1_FAST off (plus batch 128 at 2K, with
# the host split) and on: decode at 4K and 128K (the ratio target) and the 128K prefill; then
# bench_sparse's prefill rows with the fast stage-1 kernel. Timeout $1 per process. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for fast in 0 1; do
  if [ $fast = 0 ]; then ctx=2048,4096,131072; bs=1,128; else ctx=4096,131072; bs=1; fi
  SALASERVE_STAGE1_FAST=$fast timeout "${1:-170}" \
    python3 -m salaserve.bench.micro --contexts $ctx --batches $bs --prefill 131072 --max-kv-gib 20 \
    --json "$OUT/micro-fast$fast.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-fast$fast.log" | tail -9
done
SALASERVE_STAGE1_FAST=1 timeout 80 python3 -m salaserve.kernels.bench_sparse --prefill-only 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-sparse-fast.log" | tail -8
