#!/usr/bin/env bash
# Thirtieth session, call B: micro's 32K prefill per KV page format (the benchmark number behind the issue's
# fp8-KV row; run 8 had 1.42 s on fp8 pages against 1.31 on bf16), then the `sweep` GPU tests of the quantized
# kernels (34, not run since the twenty-ninth session's kernel changes) with what time is left.
# Prediction (twenty-ninth session): the 32K prefill on fp8 pages within 2% of bf16 pages.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for kv in auto fp8_e4m3; do
  timeout 150 python3 -m salaserve.bench.micro --kv-cache-dtype $kv --contexts 4096 --batches 1 --prefill 32768 --max-kv-gib 30 \
    --json "$OUT/micro-prefill-kv-$kv.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-prefill-kv-$kv.log" | tail -4
done
timeout 270 $GPU_PYTEST tests/test_gpu_quant.py -m "gpu and sweep" 2>&1 | tee "$OUT/sweep.log" | grep -E "passed|failed|Error|PASS|FAIL" | tail -12
