#!/usr/bin/env bash
# One device call: GPU tests for what changed without a GPU run (fused decode top-k, GEMV
# calibration through kernels/timing.py, the engine tests), then batch-1 decode at 4K/128K/512K
# with the torch top-k path and with SALASERVE_FUSED_TOPK=1. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-240}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_kernels_sparse.py \
  tests/test_kernels_gemv.py tests/test_gpu_engine.py -rA 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" | tail -40
for topk in 0 1; do
  echo "== SALASERVE_FUSED_TOPK=$topk"
  SALASERVE_FUSED_TOPK=$topk timeout "${2:-200}" python3 -m salaserve.bench.micro --contexts 4096,131072,524288 \
    --batches 1 --max-kv-gib 60 --json "$OUT/micro-topk$topk.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-topk$topk.log" | tail -8
done
