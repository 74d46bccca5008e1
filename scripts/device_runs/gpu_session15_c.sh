#!/usr/bin/env bash
# Fifteenth session, third GPU call: w4a16 decode at 4K (batch 1 and 8) with the wgmma kernel in
# the calibration, its start-up time, and bf16 in the same call for the ratio.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
t0=$(date +%s)
decode_4k w4a16 300 4 --quantization w4a16
echo "w4a16 micro wall $(( $(date +%s) - t0 )) s (load + quantize + calibration + capture + timing)"
decode_4k bf16 200 3
