#!/usr/bin/env bash
# Eighteenth session, run 92: PyTorch's int4 GEMM (tinygemm) against the w4 FMA decode kernel at the
# model's shapes, 1 and 8 rows.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 300 python3 scripts/w4_tinygemm_probe.py --json "$OUT/tinygemm.json" 2>&1 | grep -v -i warn | tee "$OUT/tinygemm.log"
