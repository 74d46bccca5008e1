#!/usr/bin/env bash
# Twenty-fifth session, first call. (1) The session-24 review mend (one split-K reduction for the silu and
# norm epilogues, one int16-x store) touched default-on code: silu_out's kernel test at one row. (2) The
# gated decode (SALASERVE_GATED_DECODE, session 24's _e.sh, not run then): its kernel test, then the w4a16
# step at 4K, batch 1 (plans off), off against on in one process (profile_step --ab, 7 interleaved
# rounds, its first GPU use), then the engine's graph == eager with it on.
# Prediction (perf-notes, twenty-fourth session): -0.010 to -0.016 ms per step.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 180 $GPU_PYTEST "tests/test_gpu_quant.py::test_w4a16_dp2a_silu_out_equals_the_gemv_then_silu_mul[1]" 2>&1 \
  | tail -4 | tee "$OUT/pytest-silu-out-m1.log"
timeout 110 $GPU_PYTEST "tests/test_kernels_attention.py::test_gpu_paged_decode_gated" 2>&1 | tail -4 \
  | tee "$OUT/pytest-gated.log"
timeout 150 python3 -m salaserve.bench.profile_step --graph --context 4096 --quantization w4a16 \
  --ab salaserve.kernels.triton_backend:GATED_DECODE=0,1 --rounds 7 --json "$OUT/ab-gated-w4a16.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/ab-gated-w4a16.log" | grep "median\|start-up\|Error\|error"
SALASERVE_GATED_DECODE=1 timeout 110 $GPU_PYTEST "tests/test_gpu_engine.py::test_graph_decode_equals_eager" 2>&1 \
  | tail -4 | tee "$OUT/pytest-gated-engine.log"
