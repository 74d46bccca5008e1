#!/usr/bin/env bash
# Twenty-fourth session: the int4 dp2a GEMV with its group scales and zero points loaded with the weight
# tile (SZ_AHEAD, SALASERVE_W4_SZ_AHEAD=1; the first before the PDL wait). GPU tests by node id first
# (bit-equal to the default loop at every one-row config and shape; the engine's calibrated w4a16 decode
# with it equals eager without), then the w4a16 decode step at 4K, batch 1, without and with it (plans
# off). Prediction (perf-notes, twenty-fourth session): 2.436 -> ~2.33-2.37 ms.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 200 $GPU_PYTEST "tests/test_gpu_quant.py::test_w4a16_dp2a_sz_ahead_changes_no_bit" 2>&1 | tail -4 \
  | tee "$OUT/pytest-sz-ahead.log"
SALASERVE_W4_SZ_AHEAD=1 timeout 200 $GPU_PYTEST \
  "tests/test_gpu_engine.py::test_w4a16_decode_batches_through_calibrated_kernels_equal_eager_without" 2>&1 \
  | tail -4 | tee "$OUT/pytest-sz-ahead-engine.log"
for sz in 0 1 0 1; do
  SALASERVE_W4_SZ_AHEAD=$sz timeout 120 python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 8 2>&1 | grep -v -i warn | tee -a "$OUT/step-w4a16-sz$sz.log" | grep "replay" \
    | sed "s/^/sz_ahead=$sz: /"
done
