#!/usr/bin/env bash
# One device call: the engine-level GPU parity suite (not run since the top-k / FP8-store /
# selection-metadata changes) plus the GEMV/row-kernel PDL tests, then the PDL A/B of
# scripts/device_runs/gpu_pdl.sh (batch 1/8 decode at 4K/128K with SALASERVE_PDL=0 and 1).
# Timeouts $1 (tests), $2 (each micro). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gemv.py \
  tests/test_gpu_engine.py -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
for pdl in 0 1; do
  SALASERVE_PDL=$pdl timeout "${2:-170}" python3 -m salaserve.bench.micro --contexts 4096,131072 --batches 1,8 \
    --prefill 8192 --max-kv-gib 20 --json "$OUT/micro-pdl$pdl.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/micro-pdl$pdl.log" | tail -6
done
