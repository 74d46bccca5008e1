#!/usr/bin/env bash
# One device call: verify timings and oracle end to end after the chunk-form Lightning verify,
# then the GPU verify tests.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-200}" python3 -m salaserve.bench.spec --batches 1 --ks 4,8 --new-tokens 128 --json "$OUT/spec.json" \
  2>&1 | grep -v Warning | tee "$OUT/spec.log"
timeout "${2:-170}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_kernels_lightning.py \
  tests/test_gpu_engine.py -k "gpu_verify or speculative or graph_verify" -rA 2>&1 | tee "$OUT/tests.log" \
  | grep -E "^(PASSED|FAILED|ERROR)|B=|prompt|first difference" | tail -30
