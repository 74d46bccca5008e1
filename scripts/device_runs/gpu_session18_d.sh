#!/usr/bin/env bash
# Eighteenth session, run 90: the int4 mma GEMV, x and group words in non-pure asm loads: every
# config at qkvg's shape with and without PDL, then the calibration's candidates.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 120 python3 scripts/w4_mma_debug.py 2>&1 | grep -v -i warn | tee "$OUT/debug.log"
timeout 300 python3 scripts/w4_candidates.py --m 1 8 --json "$OUT/w4-candidates.json" 2>&1 | grep -v -i warn | tee "$OUT/w4-candidates.log"
