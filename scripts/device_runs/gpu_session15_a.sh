#!/usr/bin/env bash
# Fifteenth session, first GPU call: the warpgroup-MMA int4 GEMV (quant_gemm/w4_wgmma.py) against
# the FMA kernel at the model's shapes; the prefix cache's GPU test (fixed after run 65: it
# compares the resource counters with their starting values) and its time to first token at full
# shapes (32K system prompt).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 280 python3 scripts/w4_wgmma_probe.py --m 1 8 16 --json "$OUT/probe.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/probe.log" | tail -18
timeout 140 $GPU_PYTEST tests/test_gpu_engine.py -k "prefix_cache" 2>&1 | tee "$OUT/engine.log" \
  | grep -E "rel err|passed|failed|Error" | tail -4
timeout 160 python3 scripts/prefix_cache_ttft.py --device cuda --preset full --system 32768 2>&1 \
  | grep -v -i warn | tee "$OUT/ttft.log" | grep "prefix cache"
