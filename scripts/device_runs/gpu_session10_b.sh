#!/usr/bin/env bash
# Device call B (tenth session): where a 32K fp8 (w8a8) prefill's time goes, against bf16's: the
# micro's prefill row for both in one call, then a per-kernel profile of each prompt.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 140 python3 -m salaserve.bench.micro $flag --contexts 4096 --batches 1 --prefill 32768 \
    --json "$OUT/micro-$q-prefill32k.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$q.log" | tail -4
done
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 130 python3 -m salaserve.bench.profile_step --prefill 32768 --top 24 $flag \
    --json "$OUT/prefill-profile-$q.json" 2>&1 | grep -v -i warn | tee "$OUT/prefill-profile-$q.log" | tail -28
done
