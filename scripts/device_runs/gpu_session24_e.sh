#!/usr/bin/env bash
# Twenty-fourth session, written then; its tests and --ab ran in the twenty-fifth as part of gpu_session25_a.sh (run 133): the sparse layers' output gate in the decode
# attention's last kernel (attention.paged_decode_attention(gate=), SALASERVE_GATED_DECODE=1): 8 kernels
# fewer per step. GPU tests by node id first (gated == the attention then sigmoid_mul, bit for bit, at 1
# and 8 sequences, one split and the engine's split count, dense and sparse; the engine's graph == eager
# with it on), then the decode step at 4K, batch 1, for w4a16 and bf16 (plans off) with profile_step's new
# in-process A/B (--ab: graphs captured per value, replays timed in 7 interleaved rounds; its first use on
# a GPU). Prediction (perf-notes, twenty-fourth session): -0.010 to -0.016 ms per step, every format.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE=0
timeout 200 $GPU_PYTEST "tests/test_kernels_attention.py::test_gpu_paged_decode_gated" 2>&1 | tail -4 \
  | tee "$OUT/pytest-gated.log"
SALASERVE_GATED_DECODE=1 timeout 200 $GPU_PYTEST "tests/test_gpu_engine.py::test_graph_decode_equals_eager" 2>&1 \
  | tail -4 | tee "$OUT/pytest-gated-engine.log"
for q in w4a16 none; do
  args=(--graph --context 4096 --ab salaserve.kernels.triton_backend:GATED_DECODE=0,1 --rounds 7
        --json "$OUT/ab-gated-$q.json")
  [ "$q" != none ] && args+=(--quantization "$q")
  timeout 150 python3 -m salaserve.bench.profile_step "${args[@]}" 2>&1 | grep -v -i warn | tee "$OUT/ab-gated-$q.log" \
    | grep "median\|start-up" | sed "s/^/$q: /"
done
