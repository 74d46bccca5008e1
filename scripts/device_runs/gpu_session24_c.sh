#!/usr/bin/env bash
# Twenty-fourth session: run 130's silu_out kernel test ran out of its timeout after M=1 (passed); M=2 here
# alone, then three more interleaved pairs of the w4a16 step at 4K, batch 1, without and with silu_out
# (run 130's pairs: 2.412 / 2.417 ms without, 2.352 / 2.399 with: too noisy to call).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 220 $GPU_PYTEST "tests/test_gpu_quant.py::test_w4a16_dp2a_silu_out_equals_the_gemv_then_silu_mul[2]" 2>&1 \
  | tail -4 | tee "$OUT/pytest-silu-out-m2.log"
for so in 0 1 0 1 0 1; do
  SALASERVE_W4_SILU_OUT=$so timeout 80 python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 8 2>&1 | grep -v -i warn | tee -a "$OUT/step-w4a16-siluout$so.log" | grep "replay" \
    | sed "s/^/silu_out=$so: /"
done
