#!/usr/bin/env bash
# Twenty-fifth session: the norm epilogue removed from the dp2a kernel (run 134: +0.19 ms). The kernel is
# back to the form runs 129-131 measured (plus the review mend's shared split-K reduction in silu_out's
# epilogue). Check: the default w4a16 step at 4K, batch 1 (expect 2.33-2.35 ms, runs 133 and 135), the
# engine's calibrated int4 decode == eager without, and silu_out's kernel test at one row.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 200 python3 -m salaserve.bench.profile_step --graph --context 4096 --quantization w4a16 --top 8 2>&1 \
  | grep -v -i warn | tee "$OUT/step-w4a16.log" | grep "replay\|start-up"
timeout 150 $GPU_PYTEST "tests/test_gpu_engine.py::test_w4a16_decode_batches_through_calibrated_kernels_equal_eager_without" \
  2>&1 | tail -3 | tee "$OUT/pytest-engine.log"
timeout 150 $GPU_PYTEST "tests/test_gpu_quant.py::test_w4a16_dp2a_silu_out_equals_the_gemv_then_silu_mul[1]" 2>&1 \
  | tail -3 | tee "$OUT/pytest-silu-out-m1.log"
