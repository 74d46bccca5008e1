#!/usr/bin/env bash
# Nineteenth session, run 94: the int4 decode GEMV on dp2a (quant_gemm/w4_dp2a.py): its GPU tests
# at 1 and 2 rows (every config against dequantize-then-matmul), then the calibration's candidates
# per kernel at the model's shapes (scripts/w4_candidates.py).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 240 $GPU_PYTEST tests/test_gpu_quant.py -k "w4a16 and decode_kernels and (1- or 2-)" 2>&1 | tail -6 | tee "$OUT/pytest.log"
timeout 330 python3 scripts/w4_candidates.py --m 1 2 --json "$OUT/candidates.json" 2>&1 | grep -v -i warn | tee "$OUT/candidates.log"
