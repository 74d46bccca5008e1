#!/usr/bin/env bash
# Eleventh session, in two calls (one 600 s call cannot hold both):
#   bash scripts/device_runs/gpu_session11_a.sh tests   the GPU checks the tenth session's budget did not cover
#                                           (w4, fla's fixed-length path, fp8 quantization inside the
#                                           norm, the engine), then the w4 linears one by one
#   bash scripts/device_runs/gpu_session11_a.sh micros  32K and 128K prefill bf16, 32K fp8 (median of 3 prompts)
# The Triton cache lives in the checkout (ignored), so a call on a still-warm machine reuses it.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
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
  # the one GLA parity case the tests part's timeout cut off (one sequence of 4096, bf16 inputs)
  timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short \
    tests/test_kernels_lightning.py -k "gla_prefill_fla and lens2" 2>&1 | tail -2
  timeout 250 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill 32768,131072 \
    --json "$OUT/micro-bf16-prefill.json" 2>&1 | grep -v -i warn | tail -5
  timeout 220 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 --prefill 32768 \
    --json "$OUT/micro-fp8-prefill32k.json" 2>&1 | grep -v -i warn | tail -4
  ;;
*) echo "usage: $0 tests|micros" >&2; exit 2 ;;
esac
