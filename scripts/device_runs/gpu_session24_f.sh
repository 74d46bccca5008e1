#!/usr/bin/env bash
# Twenty-fourth session, written then; run in the twenty-fifth as run 134 (tests passed; 2.408 -> 2.602 ms, so removed): the one-row int4 junction's residual add and RMSNorm
# in the o_proj / down dp2a GEMV's epilogue (w4_dp2a.NormEpilogue, SALASERVE_W4_NORM_EPILOGUE=1): 63 kernels
# fewer per w4a16 step. GPU tests by node id first (the new residual bit-equal to add_rms_norm on the GEMV's
# output, the normed row within an ulp, every one-row config and split, three calls in a row; the engine's
# calibrated w4a16 decode with it equals eager without), then the w4a16 step at 4K, batch 1 (plans off),
# off against on in one process (profile_step --ab, 7 interleaved rounds).
# Prediction (perf-notes, twenty-fourth session): -0.03 to -0.06 ms.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 220 $GPU_PYTEST "tests/test_gpu_quant.py::test_w4a16_dp2a_norm_epilogue_equals_the_gemv_then_add_rms_norm" \
  2>&1 | tail -4 | tee "$OUT/pytest-norm-epilogue.log"
SALASERVE_W4_NORM_EPILOGUE=1 timeout 200 $GPU_PYTEST \
  "tests/test_gpu_engine.py::test_w4a16_decode_batches_through_calibrated_kernels_equal_eager_without" 2>&1 \
  | tail -6 | tee "$OUT/pytest-norm-epilogue-engine.log"
timeout 150 python3 -m salaserve.bench.profile_step --graph --context 4096 --quantization w4a16 \
  --ab salaserve.kernels.triton_backend:W4_NORM_EPILOGUE=0,1 --rounds 7 --json "$OUT/ab-norm-epilogue.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/ab-norm-epilogue.log" | grep "median\|start-up"
