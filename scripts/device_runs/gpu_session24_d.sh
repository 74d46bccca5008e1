#!/usr/bin/env bash
# Twenty-fourth session, last device minutes: the row norms' warps (fused._norm_warps: 8 at the model's
# 4096 columns) against 4, in the w4a16 decode step at 4K, batch 1 (plans off), interleaved. The add +
# RMSNorm kernel runs 63 times per step, one CTA each; fewer warps mean fewer steps in its two block-wide
# reductions, more values per thread. Prediction: within +-0.02 ms either way (no basis to expect more).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
for nw in 8 4 8 4; do
  timeout 70 python3 -c "import runpy, salaserve.kernels.fused as f; f._norm_warps = lambda block: $nw if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1; runpy.run_module('salaserve.bench.profile_step', run_name='__main__')" \
    --graph --context 4096 --quantization w4a16 --top 8 2>&1 | grep -v -i warn | tee -a "$OUT/step-w4a16-normwarps$nw.log" \
    | grep "replay" | sed "s/^/norm warps $nw: /"
done
