#!/usr/bin/env bash
# Device call B (eighth session): the norm epilogue at one row (SALASERVE_NORM_EPILOGUE_ONE_ROW=1:
# o_proj / down GEMVs write the next RMSNorm from their last program, no add_rms_norm kernel) as
# an A/B against the defaults in the same call; its GPU kernel test and the engine's GPU parity
# suite with it on; bench_sparse's top-k rows again (both searches, more reps, 256K added).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_gemv.py \
  -k "norm_epilogue or real_shapes" 2>&1 | tee "$OUT/gpu_gemv_tests.log" | tail -2
micro() {  # name, env...
  local name=$1; shift
  env "$@" timeout 110 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,131072,524288 --prefill "" \
    --json "$OUT/micro-$name.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$name.log" | tail -4
}
micro default
micro norm1 SALASERVE_NORM_EPILOGUE_ONE_ROW=1
timeout 60 python3 -m salaserve.kernels.bench_sparse --decode-only --reps 50 \
  --decode-contexts 131072 262144 524288 2>&1 | grep -v -i warn | grep -E "top-k|op " | tee "$OUT/bench_topk.log"
SALASERVE_NORM_EPILOGUE_ONE_ROW=1 timeout 220 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short \
  tests/test_gpu_engine.py 2>&1 | grep -v -i warn | tee "$OUT/gpu_engine.log" \
  | grep -E "passed|failed|verify B=4|rel err|top-1" | tail -12
