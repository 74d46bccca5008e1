#!/usr/bin/env bash
# One device call after the w4 decode kernel's rewrite (4 shifts per packed word, bf16 x read as
# pairs, magic constants as arguments) and PDL on by default (also for the w4 and w8a16 GEMVs):
# GPU tests of the quantized kernels and the GEMV/PDL chain, the per-linear table at M = 1, w4a16
# and fp8 decode, then the engine parity suite in the time left (the call's budget is $1 seconds).
# Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
start=$SECONDS
budget=${1:-580}
timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_quant.py tests/test_kernels_gemv.py -rfE \
  2>&1 | tee "$OUT/gpu_tests_quant.log" | tail -4
timeout 110 python3 -m salaserve.kernels.bench_quant --m 1 --no-prefill --json "$OUT/bench-quant.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/bench-quant.log" | grep -v "^  w8a8\|^  w4" | tail -9
for q in w4a16 fp8; do
  timeout 130 python3 -m salaserve.bench.micro --quantization $q --contexts 4096 --batches 1,8 --prefill 8192 \
    --max-kv-gib 20 --json "$OUT/micro-$q.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$q.log" | tail -6
done
left=$((budget - (SECONDS - start)))
echo "engine tests with ${left}s left"
[ "$left" -gt 30 ] && timeout "$left" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_engine.py -rfE \
  2>&1 | tee "$OUT/gpu_tests_engine.log" | tail -4
