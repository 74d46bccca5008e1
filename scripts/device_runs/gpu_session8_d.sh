#!/usr/bin/env bash
# Device call D (eighth session): the silu_mul epilogue on the gate_up GEMV at one row
# (SALASERVE_SILU_EPILOGUE, default 1) against the separate silu_mul kernel (=0) in the same call,
# the GEMV GPU tests (its real-shape test included), the micro at the defaults with the 128K
# prefill, and the engine's GPU parity suite at the defaults.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_gemv.py \
  2>&1 | tee "$OUT/gpu_gemv_tests.log" | tail -2
timeout 150 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,131072,524288 --prefill 131072 \
  --json "$OUT/micro-default.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-default.log" | tail -7
SALASERVE_SILU_EPILOGUE=0 timeout 90 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,131072,524288 \
  --prefill "" --json "$OUT/micro-silu0.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-silu0.log" | tail -4
timeout 220 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short tests/test_gpu_engine.py 2>&1 \
  | tee "$OUT/gpu_engine.log" | grep -E "passed|failed|PASSED|FAILED|rel err|top-1" | tail -14
