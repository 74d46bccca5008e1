#!/usr/bin/env bash
# Twelfth session, fourth call: the new sparse prefill defaults (stage-1 2 stages, per-token kernel
# with pages from a list at 2 warps, window 2 stages) under the GPU tests, then micro: decode at 4K
# and 128K and the 128K prefill.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 100 $GPU_PYTEST tests/test_kernels_sparse.py tests/test_kv_fp8.py -k "selection or sparse_attention or fp8_pages" 2>&1 \
  | tee "$OUT/sparse.log" | grep -E "passed|failed|Error" | tail -6
timeout 200 $GPU_PYTEST tests/test_gpu_engine.py -k "matches_reference or chunked" 2>&1 | tee "$OUT/engine.log" \
  | grep -E "rel err|passed|failed|Error" | tail -6
timeout 250 python3 -m salaserve.bench.micro --contexts 4096,131072 --batches 1 --prefill 131072 \
  --prefill-repeats 3 --json "$OUT/micro.json" 2>&1 | tee "$OUT/micro.log" | grep -v -i warn | tail -8
