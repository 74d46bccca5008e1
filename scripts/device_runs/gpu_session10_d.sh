#!/usr/bin/env bash
# Device call D (tenth session): the 32K prefill with fp8 weights (one-pass quantizer, silu_mul
# fused into down's quantization) and bf16 in one call, with start-up time to spare; the
# quantizer's rows/warps A/B; the fp8/w4 GPU kernel tests.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 200 python3 -m salaserve.bench.micro $flag --contexts 4096 --batches 1 --prefill 32768 \
    --json "$OUT/micro-$q-prefill32k.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$q.log" | tail -3
done
timeout 100 python3 scripts/rowquant_ab.py "$OUT/rowquant_ab.json" 2>&1 | grep -v -i warn | tee "$OUT/rowquant_ab.log" | tail -40
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py \
  2>&1 | tee "$OUT/gpu_quant_tests.log" | tail -3
