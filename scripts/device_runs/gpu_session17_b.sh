#!/usr/bin/env bash
# Seventeenth session, second device call: the stream configs with their explicit splits and the
# L2 prefetch before the PDL wait. GPU tests, per-linear A/B at M = 1, the fp8 decode graph's
# kernel timeline at 4K (where the step's non-GEMV time goes), fp8 and bf16 decode at 4K.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 $GPU_PYTEST tests/test_gpu_quant.py -k "stream or calibration_records" 2>&1 \
  | tee "$OUT/pytest.log" | tail -3
timeout 150 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-ab.json" 1 2>&1 | grep -v -i warn | tee "$OUT/fp8-ab.log" \
  | grep -v "^           [a-z]*:\|^           fma n\|^           stream n" | tail -26
decode_4k fp8 150 4 --quantization fp8
decode_4k bf16 90 3
timeout 170 python3 -m salaserve.bench.profile_step --graph --context 4096 --top 30 --quantization fp8 \
  --json "$OUT/graph-profile-fp8.json" 2>&1 | grep -v -i warn > "$OUT/graph-profile-fp8.log"; tail -40 "$OUT/graph-profile-fp8.log"
