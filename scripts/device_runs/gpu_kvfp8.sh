#!/usr/bin/env bash
# One device call: GPU tests of the fp8 KV path, batch-1 decode at 4K/128K and a 32K prefill with
# bf16 and fp8 KV pages (or the dtypes given as $4), and w4a16 decode (skipped when $3 is 0).
# Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-120}" python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_kv_fp8.py -rA 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|Error|^E |decode splits" | tail -30
for kv in ${4:-auto fp8_e4m3}; do
  timeout "${2:-170}" python3 -m salaserve.bench.micro --kv-cache-dtype $kv --contexts 4096,131072 --batches 1 \
    --prefill 32768 --max-kv-gib 30 --json "$OUT/micro-kv-$kv.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-kv-$kv.log" | tail -7
done
[ "${3:-200}" = 0 ] || timeout "${3:-200}" python3 -m salaserve.bench.micro --quantization w4a16 --contexts 4096 --batches 1,8 \
  --prefill 32768 --max-kv-gib 20 --json "$OUT/micro-w4a16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-w4a16.log" | tail -7
