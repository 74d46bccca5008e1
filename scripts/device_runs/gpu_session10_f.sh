#!/usr/bin/env bash
# Device call F (tenth session): GPU tests of the rewritten w4 GEMV and of fla's fixed-length
# path for one-sequence prefills; 32K prefill fp8 and bf16 (with the sync-free GLA call) in one
# call; w4a16 decode at batch 1, 4K.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py -k "w4 or gla_prefill" \
  tests/test_kernels_lightning.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 150 python3 -m salaserve.bench.micro $flag --contexts 4096 --batches 1 --prefill 32768 \
    --json "$OUT/micro-$q-prefill32k.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$q.log" | tail -3
done
timeout 150 python3 -m salaserve.bench.micro --quantization w4a16 --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-w4a16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-w4a16.log" | tail -2
