#!/usr/bin/env bash
# Fifteenth session, third GPU call: w4a16 decode at 4K (batch 1 and 8) with the wgmma kernel in
# the calibration, its start-up time, and bf16 in the same call for the ratio.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
t0=$(date +%s)
timeout 300 python3 -m salaserve.bench.micro --quantization w4a16 --contexts 4096 --batches 1,8 --prefill "" \
  --json "$OUT/micro-w4a16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-w4a16.log" | tail -4
echo "w4a16 micro wall $(( $(date +%s) - t0 )) s (load + quantize + calibration + capture + timing)"
timeout 200 python3 -m salaserve.bench.micro --contexts 4096 --batches 1,8 --prefill "" \
  --json "$OUT/micro-bf16.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-bf16.log" | tail -3
