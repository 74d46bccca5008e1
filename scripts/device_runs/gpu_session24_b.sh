#!/usr/bin/env bash
# Twenty-fourth session: the int4 gate_up GEMV writing silu_mul of its output (silu_out,
# SALASERVE_W4_SILU_OUT=1): no silu_mul kernel at one row, down on bf16 x. GPU tests by node id first
# (silu_out == the GEMV then the silu_mul kernel, bit for bit, every config and split, 1-2 rows; the engine's
# calibrated w4a16 decode with it equals eager without, B=1 included), then the w4a16 decode step at 4K,
# batch 1, without and with it, interleaved (plans off), and once with lm_head in int4 too.
# Prediction (perf-notes, twenty-fourth session): 2.397 -> ~2.35-2.36 ms.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 150 $GPU_PYTEST "tests/test_gpu_quant.py::test_w4a16_dp2a_silu_out_equals_the_gemv_then_silu_mul" 2>&1 \
  | tail -4 | tee "$OUT/pytest-silu-out.log"
SALASERVE_W4_SILU_OUT=1 timeout 200 $GPU_PYTEST \
  "tests/test_gpu_engine.py::test_w4a16_decode_batches_through_calibrated_kernels_equal_eager_without" 2>&1 \
  | tail -6 | tee "$OUT/pytest-silu-out-engine.log"
for so in 0 1 0 1; do
  SALASERVE_W4_SILU_OUT=$so timeout 100 python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 8 2>&1 | grep -v -i warn | tee -a "$OUT/step-w4a16-siluout$so.log" | grep "replay" \
    | sed "s/^/silu_out=$so: /"
done
SALASERVE_W4_SILU_OUT=1 timeout 100 python3 -m salaserve.bench.profile_step --graph --context 4096 \
  --quantization w4a16 --quantize-lm-head --top 8 2>&1 | grep -v -i warn | tee "$OUT/step-w4a16-lmhead.log" \
  | grep "replay" | sed "s/^/silu_out=1, lm_head int4: /"
