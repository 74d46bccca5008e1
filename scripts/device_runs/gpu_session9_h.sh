#!/usr/bin/env bash
# Device call H (ninth session): final checks at the session's code: the GEMV GPU tests (bf16
# paths share the kernel with the fp8 one) and the engine GPU suite (with the fp8 decode test).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_gemv.py \
  2>&1 | tee "$OUT/gpu_gemv_tests.log" | tail -2
timeout 270 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short tests/test_gpu_engine.py 2>&1 \
  | tee "$OUT/gpu_engine.log" | grep -E "passed|failed|PASSED|FAILED|rel err|top-1" | tail -24
