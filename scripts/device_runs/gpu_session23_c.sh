#!/usr/bin/env bash
# Twenty-third session, call C: the TMA GEMV with its first tile (weights, scales, zeros) loaded before the
# PDL wait. Run 121: in the step it lost (2.504 -> 2.666 ms) though it won gate_up and qkvz back to back;
# the dp2a kernel loads its first tile before the wait, the TMA kernel loaded nothing. The step with it
# among the candidates (plans off), then its GPU test at every config and the engine tests with it on.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
SALASERVE_W4_TMA=1 timeout 170 python3 -m salaserve.bench.profile_step --graph --context 4096 \
  --quantization w4a16 --top 6 2>&1 | grep -v -i warn | tee "$OUT/step-w4-tma1-peeled.log" | head -10
timeout 200 $GPU_PYTEST tests/test_gpu_quant.py -k "tma" 2>&1 | tail -5 | tee "$OUT/pytest-tma.log"
SALASERVE_W4_TMA=1 timeout 150 $GPU_PYTEST tests/test_gpu_engine.py -k "graph_decode_equals_eager or w4a16_decode_batches" \
  2>&1 | tail -5 | tee "$OUT/pytest-engine-tma.log"
