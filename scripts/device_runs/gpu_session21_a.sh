#!/usr/bin/env bash
# Twenty-first session, call A: the twentieth session's two unrun calls (gpu_session20_f.sh and _g.sh)
# folded into one, at batch 1 only (the calibration then times M = 1 alone, which keeps the call
# inside the 10-minute limit):
#   1. decode at 4K with lm_head quantized on load (the issue's 3.2x row); prediction 2.59 -> ~2.50 ms;
#   2. plain w4a16 in the same call, with the plan the first run wrote (plans ignore lm_head's shape);
#   3. the PDL-off kernel timeline of the plain w4a16 decode graph (profile_step --no-pdl keeps
#      the plan's fingerprint, so the same picks run): where the step's time outside the linears goes.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=$OUT/plans
decode_4k w4a16-lmhead 330 3 --batches 1 --quantization w4a16 --quantize-lm-head
decode_4k w4a16 110 3 --batches 1 --quantization w4a16
timeout 140 python3 -m salaserve.bench.profile_step --graph --no-pdl --context 4096 --quantization w4a16 --top 24 \
  --json "$OUT/graph-profile-w4a16-nopdl.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-w4a16-nopdl.log" | head -30
