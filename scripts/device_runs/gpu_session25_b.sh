#!/usr/bin/env bash
# Twenty-fifth session: run 134's --ab baseline (W4_NORM_EPILOGUE=0: 2.408 ms) was 0.057 ms above run 133's
# (GATED_DECODE=0: 2.351 ms) on the same warm machine, the same code and defaults; the processes differed
# only in their start-up calibration. Is the step's spread the calibration's picks? Three processes each
# calibrate afresh into a plan directory of their own (SALASERVE_PLAN_CACHE=$OUT/plansN), then each plan is
# replayed again by a fresh process that loads it (same picks, new process), interleaved. If the times follow
# the plans, the picks are the spread. Then the Triton cache is tarred to $OUT (carried by later calls,
# if small enough, to save the start-up compiles).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
step() {
  SALASERVE_PLAN_CACHE=$OUT/plans$1 timeout 200 python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 8 2>&1 | grep -v -i warn | tee -a "$OUT/step-plans$1.log" | grep "replay\|start-up" \
    | sed "s/^/plans$1 ($2): /"
}
for i in 1 2 3; do step $i fresh; done
for i in 1 2 3; do step $i loaded; done
du -sh "$TRITON_CACHE_DIR"
tar -czf "$OUT/triton-cache.tgz" -C "$(dirname "$TRITON_CACHE_DIR")" "$(basename "$TRITON_CACHE_DIR")"
ls -la "$OUT/triton-cache.tgz"
