#!/usr/bin/env bash
# Twenty-second session, call A: the one-row int4 junction as one persistent kernel
# (quant_gemm.w4_junction). First its GPU tests (grid barrier: one launch bit-equal to the two-launch
# form; outputs against dequantize-then-matmul), then the A/B against the engine's three-kernel
# chain per junction and config (scripts/w4_junction_ab.py).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 240 $GPU_PYTEST tests/test_gpu_quant.py -k "junction" 2>&1 | tail -6 | tee "$OUT/pytest-junction.log"
timeout 300 python3 scripts/w4_junction_ab.py --json "$OUT/w4-junction-ab.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/w4-junction-ab.log"
