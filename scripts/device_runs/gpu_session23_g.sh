#!/usr/bin/env bash
# Twenty-third session, NOT RUN (device time spent): the row kernels and the Lightning decode step load
# what no kernel of the forward writes before the PDL wait (norm weights; the step's slot, state tile and
# decay). GPU tests by node id first (the GEMV/row-kernel chain and a Lightning layer's chain with PDL in
# a graph bit-equal to eager without PDL, the decode step in a
# graph, the engine's graph == eager), then the decode step at 4K, batch 1, for w4a16, bf16 and fp8
# (plans off). Prediction (perf-notes, twenty-third session): ~0.08 ms off every format's step
# (w4a16 2.504 -> ~2.42 ms, bf16 ~4.74 -> ~4.66, fp8 3.185 -> ~3.10).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 240 $GPU_PYTEST "tests/test_kernels_gemv.py::test_row_kernels_with_pdl_in_a_graph_change_no_bit" \
  "tests/test_kernels_lightning.py::test_gpu_lightning_chain_with_pdl_in_a_graph_changes_no_bit" \
  "tests/test_kernels_lightning.py::test_gpu_decode_step_in_cuda_graph" "tests/test_kernels_lightning.py::test_gpu_decode_step" \
  "tests/test_kernels_lightning.py::test_gpu_lightning_output_and_qk_norm_rope" \
  "tests/test_gpu_engine.py::test_graph_decode_equals_eager" 2>&1 | tail -4 | tee "$OUT/pytest-pdl-hoist.log"
for q in w4a16 none fp8; do
  args=(--graph --context 4096 --top 8); [ "$q" != none ] && args+=(--quantization "$q")
  timeout 170 python3 -m salaserve.bench.profile_step "${args[@]}" 2>&1 | grep -v -i warn \
    | tee "$OUT/step-$q.log" | grep "start-up\|replay"
done
