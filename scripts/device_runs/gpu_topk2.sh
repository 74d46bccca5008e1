#!/usr/bin/env bash
# One device call for the decode top-k: sparse GPU tests (fused top-k equals the torch path at the
# graph widths, graph replay), batch-1 decode at 4K/128K/512K, and the graph-replay kernel
# timeline at context $4 (default 131072). Timeouts $1..$3 (0 skips). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-120}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_sparse.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
[ "${2:-200}" = 0 ] || timeout "${2:-200}" python3 -m salaserve.bench.micro --contexts 4096,131072,524288 --batches 1 \
  --prefill 8192 --max-kv-gib 30 --json "$OUT/micro-topk.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-topk.log" | tail -7
[ "${3:-150}" = 0 ] || timeout "${3:-150}" python3 -m salaserve.bench.profile_step --graph --context "${4:-131072}" \
  --top 12 --json "$OUT/graph-profile.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile.log" | tail -24
