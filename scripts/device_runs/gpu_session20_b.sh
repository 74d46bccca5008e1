#!/usr/bin/env bash
# Twentieth session, run 100: w4a16 decode at 4K (batches 1 and 8) with x rounded to int16 by its
# producers (the add + RMSNorm and silu_mul kernels) where the calibration picks the rounded-x dp2a
# kernel, and bf16 in the same call; the calibration's picks (the plan file) kept.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=$OUT/plans
decode_4k w4a16 380 4 --quantization w4a16
decode_4k bf16 180 3
