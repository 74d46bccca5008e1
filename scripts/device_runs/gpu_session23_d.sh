#!/usr/bin/env bash
# Twenty-third session, call D: scripts/w4_pair_calibration_probe.py (each int4 candidate timed after its
# producer kernel, as in the step, against back to back), with the rounded-x and TMA candidates
# (SALASERVE_W4_TMA=1): runs 121-122 showed a back-to-back win (the TMA GEMV at gate_up and qkvz) turning
# into a 0.11-0.16 ms loss in the step.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
SALASERVE_W4_TMA=1 timeout 380 python3 scripts/w4_pair_calibration_probe.py --json "$OUT/w4-pair-calibration.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/w4-pair-calibration.log"
