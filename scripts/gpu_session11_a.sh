#!/usr/bin/env bash
# Eleventh session, in two calls (one 600 s call cannot hold both):
#   bash scripts/gpu_session11_a.sh tests   the GPU checks the tenth session's budget did not cover
#                                           (w4, fla's fixed-length path, fp8 quantization inside the
#                                           norm, the engine), then the w4 linears one by one
#   bash scripts/gpu_session11_a.sh micros  32K prefill fp8/bf16 (median of 3 prompts), then 128K
#                                           prefill with fp32 and bf16 GLA inputs
# The Triton cache lives in the checkout (ignored), so a call on a still-warm machine reuses it.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export TRITON_CACHE_DIR=$PWD/.triton-cache
case "${1:-}" in
tests)
  timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short --durations=8 \
    tests/test_gpu_quant.py tests/test_kernels_lightning.py -k "w4 or gla_prefill or qk_norm_rope or quantize_inside or row_quantizer" \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -12
  timeout 190 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short -s tests/test_gpu_engine.py \
    2>&1 | tee "$OUT/gpu_engine.log" | tail -3
  timeout 100 python3 -m salaserve.kernels.bench_quant --m 1 --no-prefill --json "$OUT/bench_quant_m1.json" \
    2>&1 | tee "$OUT/bench_quant_m1.log" | grep -v -i warn | tail -20
  ;;
micros)
  for q in fp8 bf16; do
    flag=""; [[ $q == fp8 ]] && flag="--quantization fp8"
    timeout 200 python3 -m salaserve.bench.micro $flag --contexts 4096 --batches 1 --prefill 32768 \
      --json "$OUT/micro-$q-prefill32k.json" 2>&1 | grep -v -i warn | tail -2
  done
  for gla in fp32 bf16; do
    SALASERVE_GLA_INPUT=$gla timeout 150 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 \
      --prefill 131072 --json "$OUT/micro-prefill128k-gla-$gla.json" 2>&1 | grep -v -i warn | tail -2
  done
  ;;
*) echo "usage: $0 tests|micros" >&2; exit 2 ;;
esac
