#!/usr/bin/env bash
# One device call after PDL reached the rest of the decode chain (Lightning, attention, top-k) and
# the w4 GEMV got 64-column / prefetch-2 configs: GPU kernel tests, bf16 decode at batch 1 and 128,
# w4a16 decode, the PDL A/B of the quantized GEMVs, then the per-linear table in the time left
# (the call's budget is $1 seconds). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
start=$SECONDS
budget=${1:-570}
timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_quant.py tests/test_kernels_lightning.py \
  tests/test_kernels_attention.py tests/test_kernels_sparse.py tests/test_kv_fp8.py -rfE 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
timeout 150 python3 -m salaserve.bench.micro --contexts 2048,4096,131072 --batches 1,128 --prefill 8192 \
  --max-kv-gib 40 --json "$OUT/micro-bf16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-bf16.log" | tail -8
timeout 130 python3 -m salaserve.bench.micro --quantization w4a16 --contexts 4096 --batches 1 --prefill 8192 \
  --max-kv-gib 20 --json "$OUT/micro-w4a16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-w4a16.log" | tail -5
timeout 80 python3 scripts/pdl_ab_quant.py 2>&1 | grep -v -i warn | tee "$OUT/pdl-ab.log" | tail -8
left=$((budget - (SECONDS - start)))
echo "bench_quant with ${left}s left"
[ "$left" -gt 40 ] && timeout "$left" python3 -m salaserve.kernels.bench_quant --m 1 --no-prefill \
  --json "$OUT/bench-quant.json" 2>&1 | grep -v -i warn | tee "$OUT/bench-quant.log" | grep -v "^  w8a8\|^  w4" | tail -9
