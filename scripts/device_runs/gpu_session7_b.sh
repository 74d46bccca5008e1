#!/usr/bin/env bash
# Device call B (seventh session): the Lightning decode kernel's program order and cache hint
# (bench_lightning --sweep), the window kernel for the forced blocks of the sparse prefill
# attention (GPU tests, bench_sparse, the 128K prefill with SALASERVE_SPARSE_ATTN_WINDOW 0 / 4 / 8).
# Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 110 python3 -m salaserve.kernels.bench_lightning --batch 1 128 --layers 24 --sweep 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-lightning.log" | head -8
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py \
  tests/test_kernels_lightning.py -k "attention or decode_step" 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
timeout 100 python3 -m salaserve.kernels.bench_sparse --prefill-only --tiles 0 --windows 4 8 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-sparse.log" | tail -8
for w in 0 8 4; do
  SALASERVE_SPARSE_ATTN_WINDOW=$w timeout 75 python3 -m salaserve.bench.micro --batches 1 --contexts 4096 \
    --prefill 131072 --json "$OUT/micro-prefill-window$w.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/micro-prefill-window$w.log" | grep -E "^ +131072" | sed "s/^/window $w: /"
done
