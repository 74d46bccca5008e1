#!/usr/bin/env bash
# Twenty-second session, call C: the int4 decode GEMV with TMA-streamed weights (quant_gemm.w4_tma):
# its GPU tests, then per shape against the dp2a picks (scripts/w4_tma_ab.py).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 $GPU_PYTEST tests/test_gpu_quant.py -k "tma" 2>&1 | tail -6 | tee "$OUT/pytest-tma.log"
timeout 300 python3 scripts/w4_tma_ab.py --json "$OUT/w4-tma-ab.json" 2>&1 | grep -v -i warn | tee "$OUT/w4-tma-ab.log"
