#!/usr/bin/env bash
# One device call for the paths prepared off by default in the fifth session (perf notes): GPU
# tests of the changed kernels, the sparse prefill attention per tile size, the 128K prefill
# with and without SALASERVE_SPARSE_ATTN_TILE=4 + SALASERVE_STAGE1_FAST=1, and the fp8 FMA GEMV
# (SALASERVE_FP8_DECODE=gemv) per linear. Timeouts $1 (tests), $2 (each other step). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout "${1:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_lightning.py \
  tests/test_kernels_sparse.py tests/test_gpu_quant.py -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
timeout "${2:-120}" python3 -m salaserve.kernels.bench_sparse --prefill-only 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-sparse.log" | tail -8
for fast in 0 1; do
  SALASERVE_SPARSE_ATTN_TILE=$((fast * 4)) SALASERVE_STAGE1_FAST=$fast timeout "${2:-120}" \
    python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill 131072 --max-kv-gib 20 \
    --json "$OUT/micro-prefill-fast$fast.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-prefill-fast$fast.log" | tail -3
done
SALASERVE_FP8_DECODE=gemv timeout "${2:-120}" python3 -m salaserve.kernels.bench_quant --m 1 8 --no-prefill \
  --json "$OUT/bench-quant-fp8gemv.json" 2>&1 | grep -v -i warn | tee "$OUT/bench-quant-fp8gemv.log" | grep -v "^  " | tail -12
