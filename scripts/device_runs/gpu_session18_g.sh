#!/usr/bin/env bash
# Eighteenth session, run 93: after the refactor of the mma GEMVs' shared pieces (split-K reduction,
# lanes, masks, emulation): the fp8 mma GEMV at every config and the w4 decode kernels (mma configs
# included) at 1 and 8 rows.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 200 $GPU_PYTEST tests/test_gpu_quant.py -k "(w4a16 and decode_kernels and (1- or 8-)) or fp8_mma" 2>&1 | tail -4 | tee "$OUT/pytest.log"
