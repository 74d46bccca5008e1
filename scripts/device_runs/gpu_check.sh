#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests and benchmarks, keep logs in $OUT.
#   scripts/device_runs/gpu_check.sh [tests] [micro] [kernels] [train]
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for stage in "$@"; do
  case "$stage" in
    tests)
      python3 -m pytest -m gpu -q -s tests/test_kernels_lightning.py tests/test_kernels_attention.py tests/test_kernels_sparse.py \
        tests/test_gpu_engine.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    micro)
      python3 -m salaserve.bench.micro ${MICRO_ARGS:-} --json "$OUT/micro.json" 2>&1 | tee "$OUT/micro.log" | grep -v Warning ;;
    kernels)
      python3 -m salaserve.kernels.bench_lightning 2>&1 | tee "$OUT/bench_lightning.log" | tail -15
      python3 -m salaserve.kernels.bench_attention 2>&1 | tee "$OUT/bench_attention.log" | tail -25 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
