#!/usr/bin/env bash
# Fourteenth session, after run 63: the tensor-core w4 GEMV with x^T of the next tile loaded
# while the current one is consumed. Parity at two shapes, the best candidate per kernel at M = 1
# and 8 per shape, then w4a16 decode at 4K (batch 1 and 8; start-up time printed).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 120 $GPU_PYTEST tests/test_gpu_quant.py -k "w4a16 and ((decode_kernels and (gate_up or qkvg)) or calibration)" 2>&1 \
  | tee "$OUT/tests.log" | grep -E "passed|failed|Error" | tail -6
timeout 150 python3 scripts/w4_candidates.py --m 1 8 --json "$OUT/w4_candidates.json" 2>&1 | grep -v -i warn
timeout 220 python3 -m salaserve.bench.micro --quantization w4a16 --contexts 4096 --batches 1,8 --prefill "" \
  --json "$OUT/micro-w4a16.json" 2>&1 | grep -v -i warn | tail -4
