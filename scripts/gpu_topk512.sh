#!/usr/bin/env bash
# One device call: sparse GPU tests (fused top-k at 8224 blocks too), batch-1 decode at 4K/512K,
# and the graph-replay timeline at 512K. Timeouts $1..$3 (0 skips). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout "${1:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_sparse.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
[ "${2:-200}" = 0 ] || timeout "${2:-200}" python3 -m salaserve.bench.micro --contexts 4096,131072,524288 --batches 1 \
  --prefill 8192 --max-kv-gib 30 --json "$OUT/micro-topk512.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-topk512.log" | tail -7
[ "${3:-150}" = 0 ] || timeout "${3:-150}" python3 -m salaserve.bench.profile_step --graph --context 524288 --top 12 \
  --json "$OUT/graph-profile-512k.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-512k.log" | tail -24
