#!/usr/bin/env bash
# Seventeenth session, last device call: the fp8 engine test with the stream configs in the
# calibration (graph vs eager logits, the picks printed), then the batch-1 decode graph's kernel
# timeline at 4K for fp8 and bf16 (where the fp8 step's extra non-GEMV time goes).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 200 $GPU_PYTEST tests/test_gpu_engine.py -k "fp8_decode_kernels" 2>&1 | tee "$OUT/pytest-engine.log" \
  | grep -E "picks|rel err|passed|failed|Error" | cut -c1-1500
for q in fp8 bf16; do
  qa=(); [ "$q" = bf16 ] || qa=(--quantization "$q")
  timeout 170 python3 -m salaserve.bench.profile_step --graph --context 4096 --top 16 "${qa[@]}" \
    --json "$OUT/graph-profile-$q.json" 2>&1 | grep -v -i warn > "$OUT/graph-profile-$q.log"
  grep -A17 "graph replay" "$OUT/graph-profile-$q.log"
done
