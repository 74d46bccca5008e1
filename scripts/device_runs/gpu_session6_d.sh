#!/usr/bin/env bash
# Device call D (sixth session): the engine GPU tests that call C did not finish (verify graph
# vs eager, speculative decoding), verbose with their printed errors; if the verify test fails,
# again with SALASERVE_STAGE1_FAST=0; then the kernel GPU tests call C did not reach; then the
# fp8 decode micro. Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 170 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short tests/test_gpu_engine.py \
  -k "graph_verify or speculative" 2>&1 | grep -v -i warn | tee "$OUT/gpu_engine.log" \
  | grep -E "PASSED|FAILED|rel err|Error|assert " | tail -30
if grep -q "graph_verify_equals_eager FAILED" "$OUT/gpu_engine.log"; then
  SALASERVE_STAGE1_FAST=0 timeout 100 python3 -m pytest -m gpu -v -s -p no:cacheprovider --tb=short \
    tests/test_gpu_engine.py -k graph_verify 2>&1 | grep -v -i warn | tee "$OUT/gpu_engine_stage1_default.log" \
    | grep -E "PASSED|FAILED|rel err|assert " | tail -12
fi
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py \
  tests/test_kernels_lightning.py tests/test_gpu_quant.py tests/test_kernels_attention.py tests/test_kv_fp8.py \
  tests/test_sampler.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -15
timeout 110 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-fp8.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-fp8.log" | tail -3
