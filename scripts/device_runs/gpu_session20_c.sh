#!/usr/bin/env bash
# Twentieth session, run 101: GPU tests of the rounded-x route. The engine's w4a16 decode graphs at 1,
# 2, 8 and 13 rows (the add + RMSNorm and silu_mul kernels writing int16 x where the calibration
# picked the rounded-x kernel) against eager without the calibration, then every dp2a config, on
# bf16 x and on x rounded beforehand, at qkvg and down (1 and 2 rows).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
# run 100's calibration picks (same kernel sources): the engine compiles only the picked kernels
mkdir -p /tmp/plans && cp docs/bench/run100-w4a16-rounded-x/plans/*.json /tmp/plans/
export SALASERVE_PLAN_CACHE=/tmp/plans
timeout 340 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 | grep -E "picks|rel err|passed|failed|Error|assert" | tee "$OUT/pytest-engine.log"
timeout 230 $GPU_PYTEST tests/test_gpu_quant.py -k "dp2a_every_config and (qkvg or down)" 2>&1 | tail -4 | tee "$OUT/pytest-dp2a.log"
