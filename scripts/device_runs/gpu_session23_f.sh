#!/usr/bin/env bash
# Twenty-third session, call F: the TMA GEMV's GPU test at every config (compiles now precompiled in
# threads; run 122's ran past its 200 s timeout), then the fp8 engine's cold start-up by phase (empty
# Triton cache, plans off; not yet timed since the compiles went parallel).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 $GPU_PYTEST tests/test_gpu_quant.py -k "tma" 2>&1 | tail -4 | tee "$OUT/pytest-tma.log"
rm -rf "$TRITON_CACHE_DIR"
/usr/bin/time -f "fp8 cold profile_step: %e s wall" env SALASERVE_PLAN_CACHE=0 timeout 280 python3 -m salaserve.bench.profile_step \
  --graph --context 4096 --quantization fp8 --top 4 2>&1 | grep -v -i warn | tee "$OUT/fp8-cold.log" | grep -i "start-up\|replay\|wall"
