#!/usr/bin/env bash
# Device call C (ninth session): fp8 decode through the GEMV by default (SALASERVE_FP8_DECODE=gemv,
# the silu_mul epilogue on gate_up at one row): the quantized GPU tests, the engine test (graph
# decode with the GEMV vs an eager w8a16 forward), the fp8 micro at batch 1 and 8, bf16 at batch 1.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py -k fp8 \
  2>&1 | tee "$OUT/gpu_quant_fp8_tests.log" | tail -3
timeout 170 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short tests/test_gpu_engine.py -k fp8_decode \
  2>&1 | tee "$OUT/gpu_engine_fp8.log" | grep -E "PASSED|FAILED|rel err|Error|assert " | tail -8
timeout 150 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1,8 --prefill "" \
  --json "$OUT/micro-fp8.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-fp8.log" | tail -4
timeout 100 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-bf16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-bf16.log" | tail -2
