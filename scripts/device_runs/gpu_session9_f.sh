#!/usr/bin/env bash
# Device call F (ninth session): graph-replay kernel timelines of the batch-1 4K decode step with
# fp8 weights (the default GEMV path) and with bf16, to find the fp8 step's extra non-GEMV time.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 150 python3 -m salaserve.bench.profile_step --graph --batch 1 --context 4096 --top 22 $flag \
    --json "$OUT/graph-profile-$q.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-$q.log" | tail -34
done
