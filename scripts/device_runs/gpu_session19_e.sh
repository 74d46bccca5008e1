#!/usr/bin/env bash
# Nineteenth session, run 98: after trimming the dp2a configs to the sweeps' winners (and the FMA
# kernel out of the 1-2 row candidates): every dp2a config at four shapes, then the engine's
# w4a16 decode graphs at 1, 2, 8 and 13 rows against eager without the calibration.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 90 $GPU_PYTEST tests/test_gpu_quant.py -k "dp2a_every_config" 2>&1 | tail -3 | tee "$OUT/pytest-dp2a.log"
timeout 200 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 | grep -E "picks|rel err|passed|failed|Error|assert" | tee "$OUT/pytest-engine.log"
