#!/usr/bin/env bash
# Nineteenth session, run 97: GPU tests of the dp2a GEMV (the engine's w4a16 decode graphs at 1, 2,
# 8 and 13 rows against eager without the calibration; every dp2a config at four shapes), then the
# candidates at one row with every candidate's time logged.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 230 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 | grep -E "picks|rel err|passed|failed|Error|assert" | tee "$OUT/pytest-engine.log"
timeout 140 $GPU_PYTEST tests/test_gpu_quant.py -k "dp2a_every_config" 2>&1 | tail -3 | tee "$OUT/pytest-dp2a.log"
timeout 190 python3 scripts/w4_candidates.py --m 1 --json "$OUT/candidates.json" --log "$OUT/all-candidates.log" 2>&1 | grep -v -i warn | tee "$OUT/candidates.log"
