#!/usr/bin/env bash
# RUN (146 / 147); DECODE_FP8_REG_CVT, DECODE_FP8_STAGES and decode_fp8_compile_stats.py were removed after these
# runs (slower, see BENCHMARKS.md): to run again, check out ec528a3 (there gpu_session27_b.sh and _d.sh).
# Twenty-eighth session, after run 146 (REG_CVT 4.914 -> 5.196 ms at 3 stages; 4.932 at 1 stage): what this
# machine's Triton (3.6) makes of each variant (sm_90 compile stats), and one stage without REG_CVT.
# Prediction: DECODE_FP8_STAGES=1 with Triton's cast within +-0.005 of 3 stages.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
python3 scripts/device_runs/decode_fp8_compile_stats.py 2>&1 | grep -v -i warn | tee "$OUT/compile-stats.txt"
PROFILE_TIMEOUT=250 profile_graph ab-stages-noreg-131080 --context 131080 --kv-cache-dtype fp8_e4m3 \
  --ab salaserve.kernels.attention:DECODE_FP8_STAGES=0,1 --rounds 5
