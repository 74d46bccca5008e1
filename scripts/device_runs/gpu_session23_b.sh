#!/usr/bin/env bash
# Twenty-third session, call B: the TMA GEMV's A/B over its new configs (256-column variants around run
# 120's winner, scales/zeros through TMA or not) at the calibration's splits, then the w4a16 decode
# step at 4K, batch 1 (profile_step --graph), with the TMA kernel among the rounded-x candidates
# (SALASERVE_W4_TMA=1) against without. Plans off: each run calibrates for itself.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 200 python3 scripts/w4_tma_ab.py --json "$OUT/w4-tma-ab.json" 2>&1 | grep -v -i warn | tee "$OUT/w4-tma-ab.log"
for tma in 1 0; do
  SALASERVE_W4_TMA=$tma timeout 170 python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 12 2>&1 | grep -v -i warn | tee "$OUT/step-w4-tma$tma.log" | head -16
done
