#!/usr/bin/env bash
# Device call E (ninth session): fp8 decode at batch 1 (column-pair GEMV, the default path) sampled
# twice around a bf16 sample, to separate run-to-run spread from the kernel change (call D's
# device ms disagreed with its own Engine.step time).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for name in fp8-a bf16 fp8-b; do
  q=""; [[ $name == fp8* ]] && q="--quantization fp8"
  timeout 130 python3 -m salaserve.bench.micro $q --contexts 4096 --batches 1 --prefill "" \
    --json "$OUT/micro-$name.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$name.log" | tail -1
done
