#!/usr/bin/env bash
# Twenty-first session, call B: does an L2 prefetch of an int4 GEMV's weights, issued while a short
# unrelated kernel runs, make the GEMV faster (scripts/l2_prefetch_probe.py)? Prediction: o_proj
# (8.4 MB, all of it prefetched during 12 us) 8 -> ~4 us; the large shapes gain about the prefetched
# bytes' DRAM time (f = 0.25 of gate_up: ~4 us of 25). Then the PDL-off timeline of the bf16 step,
# to set against call A's w4a16 one.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 300 python3 scripts/l2_prefetch_probe.py --json "$OUT/l2-prefetch-probe.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/l2-prefetch-probe.log"
timeout 200 python3 -m salaserve.bench.profile_step --graph --no-pdl --context 4096 --top 16 \
  --json "$OUT/graph-profile-bf16-nopdl.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-bf16-nopdl.log" | head -20
