#!/usr/bin/env bash
# Twentieth session, run 103: w4a16 decode at 4K, batch 2, with the rounded-x route (1) and without
# it (0), each process calibrating for its own switches.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
mkdir -p /tmp/plans && cp docs/bench/run100-w4a16-rounded-x/plans/*.json /tmp/plans/
export SALASERVE_PLAN_CACHE=/tmp/plans
for r in 1 0; do
  SALASERVE_W4_ROUNDED_X=$r timeout 165 python3 -m salaserve.bench.micro --contexts 4096 --batches 2 --prefill "" \
    --quantization w4a16 --json "$OUT/micro-w4a16-b2-rounded$r.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/micro-w4a16-b2-rounded$r.log" | tail -3
done
