#!/usr/bin/env bash
# Nineteenth session, run 95: the dp2a GEMV with x prepared once per CTA (X_PREP) next to the
# in-loop configs: the calibration's candidates per kernel at the model's shapes, 1 and 2 rows
# (every dp2a config first checked against dequantize-then-matmul).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 420 python3 scripts/w4_candidates.py --m 1 2 --json "$OUT/candidates.json" 2>&1 | grep -v -i warn | tee "$OUT/candidates.log"
