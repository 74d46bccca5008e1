#!/usr/bin/env bash
# One device call: GPU tests of the fp8 KV path and the quantized kernels, then batch-1 decode at
# 4K/128K and prefill with bf16 vs fp8 KV pages, and w4a16 decode (its calibration fixed). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout "${1:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_attention.py \
  tests/test_kv_fp8.py tests/test_gpu_quant.py tests/test_gpu_engine.py -k "not speculative" -rf 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -20
for kv in auto fp8_e4m3; do
  timeout "${2:-170}" python3 -m salaserve.bench.micro --kv-cache-dtype $kv --contexts 4096,131072 --batches 1 \
    --prefill 32768 --max-kv-gib 30 --json "$OUT/micro-kv-$kv.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-kv-$kv.log" | tail -7
done
timeout "${3:-200}" python3 -m salaserve.bench.micro --quantization w4a16 --contexts 4096 --batches 1,8 \
  --prefill 32768 --max-kv-gib 20 --json "$OUT/micro-w4a16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-w4a16.log" | tail -7
