#!/usr/bin/env bash
# One device call: verify timings and oracle end to end after the chunk-form Lightning verify,
# then the GPU verify tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout "${1:-200}" python3 -m salaserve.bench.spec --batches 1 --ks 4,8 --new-tokens 128 --json "$OUT/spec.json" \
  2>&1 | grep -v Warning | tee "$OUT/spec.log"
timeout "${2:-170}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_kernels_lightning.py \
  tests/test_gpu_engine.py -k "gpu_verify or speculative or graph_verify" -rA 2>&1 | tee "$OUT/tests.log" \
  | grep -E "^(PASSED|FAILED|ERROR)|B=|prompt|first difference" | tail -30
