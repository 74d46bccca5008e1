#!/usr/bin/env bash
# Eighteenth session, run 91: the mma GEMV as landed (run 88's kernel, opt-in): the w4 decode GPU
# tests by default and with SALASERVE_W4_MMA=1 (the calibration then times the mma configs too).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_gpu_quant.py -k "w4a16 and (decode_kernels or calibration)" 2>&1 | tail -4 | tee "$OUT/pytest-default.log"
SALASERVE_W4_MMA=1 $GPU_PYTEST tests/test_gpu_quant.py -k "w4a16 and calibration" 2>&1 | tail -4 | tee "$OUT/pytest-mma.log"
