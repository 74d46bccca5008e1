#!/usr/bin/env bash
# One device call: programmatic dependent launch A/B. GPU GEMV/row-kernel tests (graph replays
# with PDL bit-identical), then batch-1/8 decode at 4K/128K without and with SALASERVE_PDL=1.
# Timeouts $1 (tests), $2 (each micro). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gemv.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
for pdl in 0 1; do
  SALASERVE_PDL=$pdl timeout "${2:-170}" python3 -m salaserve.bench.micro --contexts 4096,131072 --batches 1,8 \
    --prefill 8192 --max-kv-gib 20 --json "$OUT/micro-pdl$pdl.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/micro-pdl$pdl.log" | tail -6
done
