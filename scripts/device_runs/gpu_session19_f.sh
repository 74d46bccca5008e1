#!/usr/bin/env bash
# Nineteenth session, NOT RUN (the session's device time ran out): the GPU checks runs 97-98 could
# not finish inside their timeouts (compiles), with room for them. Every dp2a config at four shapes
# (1 and 2 rows), the engine's w4a16 decode graphs at 1, 2, 8 and 13 rows against eager without the
# calibration, then the w4a16 decode step at 4K against bf16 (the commit's kernels: NaN-propagating
# maxima since the last measurement).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 240 $GPU_PYTEST tests/test_gpu_quant.py -k "dp2a_every_config" 2>&1 | tail -3 | tee "$OUT/pytest-dp2a.log"
timeout 330 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 | grep -E "picks|rel err|passed|failed|Error|assert" | tee "$OUT/pytest-engine.log"
