#!/usr/bin/env bash
# Eighteenth session, run 86: the int4 GEMV on mma.sync (quant_gemm/w4_mma.py). GPU tests of the
# w4 decode kernels (every mma config against dequantize-then-matmul), then the calibration's
# candidates at the model's shapes, best per kernel, at 1 and 8 rows.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_gpu_quant.py -k "w4a16 and (decode_kernels or calibration)" 2>&1 | tail -5 | tee "$OUT/pytest.log"
timeout 300 python3 scripts/w4_candidates.py --m 1 8 --json "$OUT/w4-candidates.json" 2>&1 | grep -v -i warn | tee "$OUT/w4-candidates.log"
