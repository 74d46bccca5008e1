#!/usr/bin/env bash
# Twelfth session, last call: every engine GPU test at the final code (speculative decoding, graph
# verify and the fp8 graph included), the sparse attention kernels, then the 128K prefill once more.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 60 $GPU_PYTEST tests/test_kernels_sparse.py -k "sparse_attention" 2>&1 | tee "$OUT/sparse.log" \
  | grep -E "passed|failed|Error" | tail -4
timeout 240 $GPU_PYTEST tests/test_gpu_engine.py 2>&1 | tee "$OUT/engine.log" | grep -E "rel err|passed|failed|Error" | tail -24
timeout 150 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill 131072 \
  --prefill-repeats 2 --json "$OUT/micro.json" 2>&1 | tee "$OUT/micro.log" | grep -v -i warn | tail -6
