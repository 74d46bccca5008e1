#!/usr/bin/env bash
# Device call A (seventh session): the GPU engine suite with the decode lse-partition fix
# (1db8fdb; run 21's verify graph-vs-eager failure), the sparse kernel GPU tests (the lse change),
# then the micro at batch 1 (4K, 128K) and batch 128 (2K). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 250 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short tests/test_gpu_engine.py 2>&1 \
  | grep -v -i warn | tee "$OUT/gpu_engine.log" | grep -E "PASSED|FAILED|verify B=|rel err|Error|assert " | tail -30
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py 2>&1 \
  | tee "$OUT/gpu_sparse.log" | tail -5
timeout 110 python3 -m salaserve.bench.micro --contexts 4096,131072 --batches 1 --prefill "" \
  --json "$OUT/micro-b1.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-b1.log" | tail -5
timeout 100 python3 -m salaserve.bench.micro --contexts 2048 --batches 128 --prefill "" --max-kv-gib 20 \
  --json "$OUT/micro-b128.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-b128.log" | tail -4
