#!/usr/bin/env bash
# Device call I (ninth session): fp8 decode at batch 1 (4K) with the calibration as is and with
# SALASERVE_FP8_GEMV_MARGIN=0.1 (the GEMV kept unless w8a16 is >10% faster: gate_up moves to the
# GEMV with its silu_mul epilogue, chained under PDL). The switch existed for this call only
# (commit f548481): measured slower (BENCHMARKS run 43), removed at the next commit.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 140 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 --batches 1 --prefill "" \
  --json "$OUT/micro-fp8-margin0.json" 2>&1 | grep -v -i warn | tail -1
SALASERVE_FP8_GEMV_MARGIN=0.1 timeout 90 python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 \
  --batches 1 --prefill "" --json "$OUT/micro-fp8-margin10.json" 2>&1 | grep -v -i warn | tail -1
