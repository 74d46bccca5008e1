#!/usr/bin/env bash
# Fifteenth session, second GPU call: the wgmma int4 GEMV wired in (repacked copies attached at
# start-up, calibrated at 4-16 rows): its kernel tests at every shape and M, the calibration test,
# and the engine test (decode batches 8 and 13 through the graphs vs eager without the copies).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 230 $GPU_PYTEST tests/test_gpu_quant.py -k "w4a16" 2>&1 | tee "$OUT/quant.log" \
  | grep -E "passed|failed|Error" | tail -6
timeout 330 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 | tee "$OUT/engine.log" \
  | grep -E "rel err|picks|passed|failed|Error" | tail -6
