#!/usr/bin/env bash
# Twentieth session, run 99: the checks session 19 could not finish (scripts/device_runs/gpu_session19_f.sh):
# every dp2a config at four shapes (1 and 2 rows), then the engine's w4a16 decode graphs at 1, 2, 8
# and 13 rows against eager without the calibration.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 240 $GPU_PYTEST tests/test_gpu_quant.py -k "dp2a_every_config" 2>&1 | tail -4 | tee "$OUT/pytest-dp2a.log"
timeout 330 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 | grep -E "picks|rel err|passed|failed|Error|assert" | tee "$OUT/pytest-engine.log"
