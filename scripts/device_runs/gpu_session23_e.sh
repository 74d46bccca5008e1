#!/usr/bin/env bash
# Twenty-third session, call E: where the TMA GEMV loses in the step (runs 121-122: step 2.504 -> 2.612-2.666
# ms with it in, though it wins gate_up, qkvz and down back to back and after its producer, run 123).
# The decode graph's PDL-off timeline (kernel times do not overlap) with SALASERVE_W4_TMA=1 against 0.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
for tma in 1 0; do
  SALASERVE_W4_TMA=$tma timeout 140 python3 -m salaserve.bench.profile_step --graph --no-pdl --context 4096 \
    --quantization w4a16 --top 14 2>&1 | grep -v -i warn | tee "$OUT/step-nopdl-w4-tma$tma.log" | grep -A10 "replay\|linears in"
done
