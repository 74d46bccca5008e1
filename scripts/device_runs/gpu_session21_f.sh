#!/usr/bin/env bash
# Twenty-first session, NEVER RUN as such: scripts/device_runs/gpu_session23_d.sh (run 123) ran the extended probe. The question was:
# after its producer kernel rather than back to back (scripts/w4_pair_calibration_probe.py)?
# Prediction: o_proj (7.8 us in the step against 6.0-6.3 back to back) and qkvg prefer fewer splits
# in the pair, ~0.5-1 us each; the large shapes keep their picks.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 400 python3 scripts/w4_pair_calibration_probe.py --json "$OUT/w4-pair-calibration.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/w4-pair-calibration.log"
