#!/usr/bin/env bash
# One device call for the issue-7 kernels: GPU parity tests of the quantized linears, the
# per-shape kernel benchmark (old vs new decode GEMVs, prefill paths), then decode/prefill of the
# full model with fp8 and w4a16 weights quantized on load. Logs in $OUT.
#   scripts/device_runs/gpu_quant2.sh [test_timeout bench_timeout micro_timeout]   (BENCH_ARGS: bench_quant flags)
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_quant.py -rf 2>&1 \
  | tee "$OUT/gpu_quant_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -20
timeout "${2:-330}" python3 -m salaserve.kernels.bench_quant ${BENCH_ARGS:---m 1 2 4 8 16} --json "$OUT/bench_quant.json" \
  2>&1 | grep -v -i warn | tee "$OUT/bench_quant.log" | grep -v "^  w4 M="
for q in fp8 w4a16; do
  timeout "${3:-200}" python3 -m salaserve.bench.micro --quantization $q --contexts 4096 --batches 1,8 \
    --prefill 32768 --max-kv-gib 20 --json "$OUT/micro-$q.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$q.log" | tail -8
done
