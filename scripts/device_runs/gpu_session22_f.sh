#!/usr/bin/env bash
# Twenty-second session, NEVER RUN: superseded by scripts/device_runs/gpu_session23_b.sh and _c.sh (runs 121-122), which did this step comparison; SALASERVE_W4_TMA_GROUP no longer exists (the choice is in each config).
# its A/B: the w4a16 decode step at 4K, batch 1, with the TMA kernel among the rounded-x candidates
# (SALASERVE_W4_TMA=1, the form that launched in SALASERVE_W4_TMA_GROUP) against without, one call, then
# the GPU engine tests with it on (graph == eager). Plans off: each run calibrates for itself.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0 SALASERVE_W4_TMA_GROUP=${SALASERVE_W4_TMA_GROUP:-0}
for tma in 0 1; do
  SALASERVE_W4_TMA=$tma timeout 200 python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 8 2>&1 | grep -v -i warn | tee "$OUT/step-w4-tma$tma.log" | head -12
done
SALASERVE_W4_TMA=1 timeout 150 $GPU_PYTEST tests/test_gpu_engine.py -k "graph_decode_equals_eager or w4a16_decode_batches" \
  2>&1 | tail -6 | tee "$OUT/pytest-engine-tma.log"
