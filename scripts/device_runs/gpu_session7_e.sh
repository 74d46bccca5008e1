#!/usr/bin/env bash
# Device call E (seventh session): the final defaults (top-k 2 bits per pass, window kernel 8,
# slot-major Lightning order) under the GPU tests of the sparse kernels and the engine, then the
# micro at batch 1 as run 24 ran it (4K, 128K; 128K prefill) and at 512K. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py \
  tests/test_kernels_lightning.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -3
timeout 200 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short tests/test_gpu_engine.py 2>&1 \
  | grep -v -i warn | tee "$OUT/gpu_engine.log" | grep -E "passed|failed|verify B=4|rel err [1-9]" | tail -8
timeout 110 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,131072 --prefill 131072 \
  --json "$OUT/micro-b1.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-b1.log" | tail -5
timeout 70 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,524288 --prefill "" \
  --json "$OUT/micro-b1-512k.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-b1-512k.log" | tail -2
