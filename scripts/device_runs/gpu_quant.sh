#!/usr/bin/env bash
# Device call: decode/prefill micro-benchmark for bf16, fp8 and w4a16 (quantized on load).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for q in fp8 w4a16; do
  timeout 200 python3 -m salaserve.bench.micro --quantization $q --contexts 4096 --batches 1,8 \
    --prefill 32768 --max-kv-gib 20 --json "$OUT/micro-$q.json" 2>&1 | grep -v -i warn | tail -8
done
