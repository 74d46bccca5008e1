#!/usr/bin/env bash
# Prepared for the next device session (not run yet): the GPU checks the tenth session's budget
# did not cover (w4, fla's fixed-length path, fp8 quantization inside the norm, the engine), the
# 32K prefill fp8/bf16 (median of 3 prompts), then the 128K prefill after the host-side fixes
# (sync-free one-sequence GLA, q/k written in fla's input dtype) with the bf16 GLA opt-in next to it.
# Longer than one 600 s call: run the tests and the micros as two calls.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short \
  tests/test_gpu_quant.py tests/test_kernels_lightning.py -k "w4 or gla_prefill or qk_norm_rope or quantize_inside or row_quantizer" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -3
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short -s tests/test_gpu_engine.py \
  2>&1 | tee "$OUT/gpu_engine.log" | tail -3
for q in fp8 bf16; do
  flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
  timeout 200 python3 -m salaserve.bench.micro $flag --contexts 4096 --batches 1 --prefill 32768 \
    --json "$OUT/micro-$q-prefill32k.json" 2>&1 | grep -v -i warn | tail -2
done
for gla in fp32 bf16; do
  SALASERVE_GLA_INPUT=$gla timeout 150 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 \
    --prefill 131072 --json "$OUT/micro-prefill128k-gla-$gla.json" 2>&1 | grep -v -i warn | tail -2
done
