#!/usr/bin/env bash
# One device call for speculative decoding (issue 8): the spec benchmark, then the GPU tests of
# the verify path. Logs and JSON in $OUT.   scripts/device_runs/gpu_spec.sh [bench-seconds] [test-seconds]
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-330}" python3 -m salaserve.bench.spec ${SPEC_ARGS:-} --json "$OUT/spec.json" 2>&1 \
  | grep -v Warning | tee "$OUT/spec.log"
timeout "${2:-240}" python3 -m pytest -m gpu -q -s -p no:cacheprovider \
  tests/test_kernels_lightning.py tests/test_gpu_engine.py -k "verify or speculative" 2>&1 \
  | tee "$OUT/gpu_spec_tests.log" | grep -E "passed|failed|Error|error|assert|verify|prompt" | tail -40
