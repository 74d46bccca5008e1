#!/usr/bin/env bash
# For the first GPU call after the fourteenth session: the prefix cache's GPU test (fixed after
# run 65: it compares the resource counters with their starting values), the prefix cache's time
# to first token at full shapes (32K system prompt), and w4a16 decode with the trimmed calibration
# (start-up time; run 64 had 147 s with the tensor-core kernel timed at every bucket).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 150 $GPU_PYTEST tests/test_gpu_engine.py -k "prefix_cache" 2>&1 | tee "$OUT/engine.log" \
  | grep -E "rel err|passed|failed|Error" | tail -4
timeout 200 python3 scripts/prefix_cache_ttft.py --device cuda --preset full --system 32768 2>&1 \
  | grep -v -i warn | tee "$OUT/ttft.log" | grep "prefix cache"
timeout 200 python3 -m salaserve.bench.micro --quantization w4a16 --contexts 4096 --batches 1,8 --prefill "" \
  --json "$OUT/micro-w4a16.json" 2>&1 | grep -v -i warn | tail -4
