#!/usr/bin/env bash
# Nineteenth session, run 96: w4a16 decode at 4K (batches 1 and 8) with the dp2a GEMV among the
# calibration's candidates, and bf16 in the same call.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
decode_4k w4a16 330 4 --quantization w4a16
decode_4k bf16 200 3
