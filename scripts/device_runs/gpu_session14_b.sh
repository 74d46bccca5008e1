#!/usr/bin/env bash
# Fourteenth session: the int4 decode GEMV on tensor cores (quant_gemm/w4_tc.py), new candidate
# of calibrate_w4. Its GPU parity at the model's shapes (every config, M = 1..16), the per-linear
# timings of every candidate at M = 1 and 8, then w4a16 and bf16 decode at 4K (batch 1 and 8).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 170 $GPU_PYTEST tests/test_gpu_quant.py -k "w4a16 and (decode_kernels or calibration)" 2>&1 \
  | tee "$OUT/tests.log" | grep -E "passed|failed|Error" | tail -8
timeout 200 python3 -m salaserve.kernels.bench_quant --m 1 8 --no-prefill --json "$OUT/bench_quant.json" 2>&1 \
  | grep -v -i warn > "$OUT/bench_quant.log"
grep -vE "^  w4 M=|^  fp8|^  w8a8" "$OUT/bench_quant.log" | tail -16
for q in "--quantization w4a16" ""; do
  timeout 100 python3 -m salaserve.bench.micro $q --contexts 4096 --batches 1,8 --prefill "" \
    --json "$OUT/micro${q#--quantization }.json" 2>&1 | grep -v -i warn | tail -3
done
