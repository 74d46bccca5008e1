#!/usr/bin/env bash
# Prepared for the next device session (not run yet): the GPU checks the tenth session's budget
# did not cover, then the 128K prefill after its two host-side fixes (sync-free one-sequence GLA,
# q/k written in fla's input dtype) with the bf16 opt-in next to it.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short \
  tests/test_gpu_quant.py tests/test_kernels_lightning.py -k "w4 or gla_prefill or qk_norm_rope" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -3
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short -s tests/test_gpu_engine.py \
  2>&1 | tee "$OUT/gpu_engine.log" | tail -3
for gla in fp32 bf16; do
  SALASERVE_GLA_INPUT=$gla timeout 150 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 \
    --prefill 131072 --json "$OUT/micro-prefill128k-gla-$gla.json" 2>&1 | grep -v -i warn | tail -2
done
