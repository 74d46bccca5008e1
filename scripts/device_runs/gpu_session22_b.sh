#!/usr/bin/env bash
# Twenty-second session, call B: the junction kernel's GEMVs in split-K order (CTAs running together
# read the same K rows of neighbouring columns) against stream-K order, three configs (run 116: the single-segment form at 96-132 registers).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 400 python3 scripts/w4_junction_ab.py --configs 1,3,4 --orders split --json "$OUT/w4-junction-order.json" \
  2>&1 | grep -v -i warn | tee "$OUT/w4-junction-order.log"
