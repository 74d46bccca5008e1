#!/usr/bin/env bash
# Device call C (seventh session): the window kernel with a branch-free per-token loop
# (bench_sparse), the GPU tests of the changed kernels, then the micro with the slot-major
# Lightning order at batch 128: decode at batch 1 (2K, 4K, 128K, 512K) and 128 (2K, 4K), prefill
# 128K; the 128K prefill again with SALASERVE_SPARSE_ATTN_WINDOW=$1 (default 4). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 100 python3 -m salaserve.kernels.bench_sparse --prefill-only --tiles 0 --windows 4 8 2>&1 | grep -v -i warn \
  | tee "$OUT/bench-sparse.log" | grep "attn"
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py \
  tests/test_kernels_lightning.py -k "attention or decode_step" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
timeout 230 python3 -m salaserve.bench.micro --batches 1,128 --contexts 2048,4096,131072,524288 --prefill 131072 \
  --max-kv-gib 20 --json "$OUT/micro.json" 2>&1 | grep -v -i warn | tee "$OUT/micro.log" | tail -9
SALASERVE_SPARSE_ATTN_WINDOW=${1:-4} timeout 80 python3 -m salaserve.bench.micro --batches 1 --contexts 4096 \
  --prefill 131072 --json "$OUT/micro-prefill-window.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/micro-prefill-window.log" | grep -E "^ +131072" | sed "s/^/window ${1:-4}: /"
