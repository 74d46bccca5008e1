#!/usr/bin/env bash
# Device call E (tenth session): where the 32K prefill's wall time has no kernel running, fp8 and
# bf16: profile_step --prefill with its timeline (largest gaps, blocking CUDA runtime calls).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 200 python3 -m salaserve.bench.profile_step --prefill 32768 --top 6 $flag \
    --json "$OUT/prefill-timeline-$q.json" 2>&1 | grep -v -i warn | tee "$OUT/prefill-timeline-$q.log" | tail -22
done
