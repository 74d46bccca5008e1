#!/usr/bin/env bash
# Device call A (eighth session): the top-k score search ("score", new default) against the key
# search ("key", the bit-by-bit kernel of runs 24/26) and the silu_mul prologue at one row, each as
# an A/B in the same call: GPU top-k tests, the batch-1 micro at 4K/128K/512K in three processes
# (defaults, SALASERVE_TOPK_SEARCH=key, SALASERVE_SILU_PROLOGUE_ONE_ROW=1), bench_sparse's top-k
# rows (both searches in one process), then the sparse and gemv GPU tests. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py -k topk \
  2>&1 | tee "$OUT/gpu_topk_tests.log" | tail -2
micro() {  # name, env...
  local name=$1; shift
  env "$@" timeout 130 python3 -m salaserve.bench.micro --batches 1 --contexts 4096,131072,524288 --prefill "" \
    --json "$OUT/micro-$name.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$name.log" | tail -4
}
micro default
micro key SALASERVE_TOPK_SEARCH=key
micro silu1 SALASERVE_SILU_PROLOGUE_ONE_ROW=1
timeout 60 python3 -m salaserve.kernels.bench_sparse --decode-only --decode-contexts 131072 524288 2>&1 \
  | grep -v -i warn | tee "$OUT/bench_sparse_topk.log" | tail -14
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py \
  tests/test_kernels_gemv.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -3
