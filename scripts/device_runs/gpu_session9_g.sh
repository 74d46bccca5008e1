#!/usr/bin/env bash
# Device call G (ninth session): the fp8 calibration times gate_up as the one-row silu_mul junction
# runs it; the fp8 GPU tests, two fp8 micros at batch 1 (4K) and the graph profile's kernel mix.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_gpu_quant.py -k "fp8_gemv or fp8_fma" \
  2>&1 | tee "$OUT/gpu_fp8_tests.log" | tail -2
for name in fp8-a fp8-b; do
  timeout 130 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 --prefill "" \
    --json "$OUT/micro-$name.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$name.log" | tail -1
done
timeout 130 python3 -m salaserve.bench.profile_step --graph --batch 1 --context 4096 --top 8 --quantization fp8 \
  --json "$OUT/graph-profile-fp8.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-fp8.log" | tail -12
