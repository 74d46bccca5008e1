#!/usr/bin/env bash
# Twenty-first session, NOT RUN (device time spent): checks and numbers for the session's last three
# changes, for the next session's first call.
#   1. Cold start-up of the w4a16 engine with its phases printed (runner.startup_phases): load,
#      prepare weights, calibration, warm-up, graph capture. Now the bf16 calibration times only
#      lm_head in a quantized model, and each calibration compiles all its shapes and buckets in
#      one batch. Prediction: start-up 188 -> ~150 s, calibration well under half of it;
#      the rest is warm-up compiles and fla's autotuning.
#   2. The GPU engine tests whose start-up runs the bf16 calibration on the plain shapes
#      (graph == eager for bf16, fp8 and w4a16).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
rm -rf /tmp/tc-cold && mkdir -p /tmp/tc-cold
t0=$SECONDS
TRITON_CACHE_DIR=/tmp/tc-cold timeout 300 python3 -m salaserve.bench.profile_step --graph --context 4096 \
  --quantization w4a16 --top 3 2>&1 | grep -v -i warn | tee "$OUT/startup-phases.log" | head -6
echo "cold start-up + one profiled replay: $((SECONDS - t0)) s" | tee -a "$OUT/startup-phases.log"
TRITON_CACHE_DIR=/tmp/tc-cold timeout 280 $GPU_PYTEST tests/test_gpu_engine.py \
  -k "graph_decode_equals_eager or fp8_decode_kernels or w4a16_decode_batches" 2>&1 | tail -8 \
  | tee "$OUT/pytest-engine.log"
