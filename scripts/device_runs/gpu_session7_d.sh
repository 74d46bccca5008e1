#!/usr/bin/env bash
# Device call D (seventh session): the decode top-k with 2 / 4 threshold bits per pass (GPU
# equality tests, then bench_sparse's decode select), and three micro processes at batch 1 (4K,
# 128K, 512K decode; 128K prefill timed twice, the second reported), each with one top-k setting
# (decode only) and one window setting (prefill only): (bits 1, window 0), (4, 4), (2, 8).
# Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
SALASERVE_TOPK_RADIX_BITS=4 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short \
  tests/test_kernels_sparse.py -k "topk or decode_selection" 2>&1 | tee "$OUT/gpu_tests_bits4.log" | tail -2
for cfg in "1 0" "4 4" "2 8"; do
  set -- $cfg
  SALASERVE_TOPK_RADIX_BITS=$1 SALASERVE_SPARSE_ATTN_WINDOW=$2 timeout 120 python3 -m salaserve.bench.micro \
    --batches 1 --contexts 4096,131072,524288 --prefill 131072 --json "$OUT/micro-bits$1-window$2.json" 2>&1 \
    | grep -v -i warn | tee "$OUT/micro-bits$1-window$2.log" | grep -E "^ +(1 |131072)" | sed "s/^/bits $1 window $2: /"
done
timeout 90 python3 -m salaserve.kernels.bench_sparse --topk-bits 1 2 4 --decode-contexts 131072 524288 --tiles \
  --windows 2>&1 | grep -v -i warn | tee "$OUT/bench-sparse-topk.log" | grep "decode select"
