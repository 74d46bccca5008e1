#!/usr/bin/env bash
# Sixteenth session, third device call: what the fifteenth session left unmeasured after its
# device time ran out. w4a16 decode at 4K with the [N, K/8] wgmma layout, the w4a16 engine's
# start-up with a cold Triton kernel cache (run 69's 22.4 s was warm), bf16 in the same call for
# the ratio, then the GPU engine test of the w4a16 decode path (refactored onto graph_vs_eager).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export TRITON_CACHE_DIR=/tmp/cold-triton-cache  # a fresh cache: start-up compiles everything
t0=$(date +%s)
decode_4k w4a16 260 4 --quantization w4a16
echo "w4a16 micro wall $(( $(date +%s) - t0 )) s with a cold kernel cache"
decode_4k bf16 100 3
timeout 200 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 \
  | tee "$OUT/engine.log" | grep -E "rel err|passed|failed|Error" | tail -6
