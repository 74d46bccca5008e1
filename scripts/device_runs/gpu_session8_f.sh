#!/usr/bin/env bash
# Device call F (eighth session): the silu_mul epilogue at 2-16 rows too (SALASERVE_SILU_EPILOGUE_ROWS=16,
# instead of the silu_mul prologue on down) against the default (1) at batch 8 in the same call,
# and the engine's GPU parity suite with it on (batch 3-13 graphs, verify steps).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
micro() {  # name, env...
  local name=$1; shift
  env "$@" timeout 100 python3 -m salaserve.bench.micro --batches 8 --contexts 4096 --prefill "" \
    --json "$OUT/micro-$name.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$name.log" | tail -3
}
micro b8-rows16 SALASERVE_SILU_EPILOGUE_ROWS=16
micro b8-rows1 SALASERVE_SILU_EPILOGUE_ROWS=1
SALASERVE_SILU_EPILOGUE_ROWS=16 timeout 200 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short \
  tests/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_engine.log" | grep -E "passed|failed|rel err|top-1" | tail -14
