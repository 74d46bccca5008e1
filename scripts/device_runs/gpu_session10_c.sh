#!/usr/bin/env bash
# Device call C (tenth session): the one-pass row quantizer and silu_mul fused into down's fp8
# quantization: their GPU tests, then the 32K prefill, fp8 and bf16 in one call, and the fp8
# prompt's kernel profile.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py \
  -k "row_quantizer or silu_mul or quant_linear" 2>&1 | tee "$OUT/gpu_rowquant_tests.log" | tail -3
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 140 python3 -m salaserve.bench.micro $flag --contexts 4096 --batches 1 --prefill 32768 \
    --json "$OUT/micro-$q-prefill32k.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$q.log" | tail -4
done
timeout 130 python3 -m salaserve.bench.profile_step --prefill 32768 --top 16 --quantization fp8 \
  --json "$OUT/prefill-profile-fp8.json" 2>&1 | grep -v -i warn | tee "$OUT/prefill-profile-fp8.log" | tail -20
