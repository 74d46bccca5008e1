#!/usr/bin/env bash
# Device call C (eighth session): the norm epilogue's second version (the row read back in pieces,
# registers as without it) against the defaults in the same call, pieces of 1024 and 512; its GPU
# kernel test first.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_gemv.py \
  -k "norm_epilogue" 2>&1 | tee "$OUT/gpu_gemv_tests.log" | tail -2
micro() {  # name, env...
  local name=$1; shift
  env "$@" timeout 110 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,131072,524288 --prefill "" \
    --json "$OUT/micro-$name.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$name.log" | tail -4
}
micro default
micro norm1024 SALASERVE_NORM_EPILOGUE_ONE_ROW=1 SALASERVE_NORM_CHUNK=1024
micro norm512 SALASERVE_NORM_EPILOGUE_ONE_ROW=1 SALASERVE_NORM_CHUNK=512
micro default2
