#!/usr/bin/env bash
# Twenty-first session, call C: the decode step at 4K, batch 1, from the captured graph's replay
# (profile_step --graph, PDL on: the micro-benchmark's device ms; its start-up calibrates batch 1
# only, micro's every graph batch and ran past 330 s in call A): w4a16, w4a16 with lm_head
# quantized on load, bf16. w4a16 reuses run 105's plan (same kernel sources). Prediction for
# --quantize-lm-head: 2.59 -> ~2.50 ms (~1.93x bf16).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
mkdir -p "$OUT/plans" && cp docs/bench/run105-w4a16-nopdl-profile/plans/*.json "$OUT/plans/"
export SALASERVE_PLAN_CACHE=$OUT/plans
run() {
  local label=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m salaserve.bench.profile_step --graph --context 4096 --top 8 "$@" \
    --json "$OUT/graph-profile-$label.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-$label.log" | head -10
}
run w4a16 150 --quantization w4a16
run w4a16-lmhead 200 --quantization w4a16 --quantize-lm-head
run bf16 150
run w4a16-again 120 --quantization w4a16
