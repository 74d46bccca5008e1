#!/usr/bin/env bash
# One device call after fusing the layer junctions into the GEMVs: decode/verify timings (spec
# bench, batch 1 and 8), engine-vs-reference parity and graph parity, then more micro points.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-220}" python3 -m salaserve.bench.spec --batches 1,8 --ks 4,8 --new-tokens 0 --json "$OUT/spec.json" \
  2>&1 | grep -v Warning | tee "$OUT/spec.log"
timeout "${2:-220}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_engine.py \
  -k "engine_matches_reference or graph_decode_equals_eager" 2>&1 | tee "$OUT/parity.log" \
  | grep -E "passed|failed|Error|assert|B=|prompt" | tail -20
timeout "${3:-120}" python3 -m salaserve.bench.micro --contexts 2048,131072 --batches 1,128 --prefill 32768 \
  --max-kv-gib 40 --json "$OUT/micro.json" 2>&1 | grep -v Warning | tee "$OUT/micro.log"
