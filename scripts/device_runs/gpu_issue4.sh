#!/usr/bin/env bash
# One device call: CUDA-graph parity tests (decode width steps, verify), then the micro-benchmark
# points issue 4 asks for (batch 128 at 2K, 128K/512K decode, 1M-token prefill). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-230}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_engine.py \
  -k "graph_decode_equals_eager or graph_verify_equals_eager" 2>&1 | tee "$OUT/graph_tests.log" \
  | grep -E "passed|failed|Error|assert|B=" | tail -30
timeout "${2:-340}" python3 -m salaserve.bench.micro --contexts 2048,4096,131072,524288 --batches 1,128 \
  --prefill 131072,1048576 --max-kv-gib 60 --json "$OUT/micro.json" 2>&1 | grep -v Warning | tee "$OUT/micro.log"
