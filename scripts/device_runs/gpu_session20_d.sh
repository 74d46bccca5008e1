#!/usr/bin/env bash
# Twentieth session, run 102 (on the machine run 101 left warm): the rounded-x dp2a GEMV against the
# calibrated dp2a GEMV on bf16 x, per shape at 1 and 2 rows (scripts/w4_rounded_ab.py).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 280 python3 scripts/w4_rounded_ab.py --m 1 2 --json "$OUT/rounded-ab.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/rounded-ab-all.log" | grep -v "^  "
