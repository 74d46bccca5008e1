#!/usr/bin/env bash
# Twenty-fifth session, NOT RUN (device time spent): why do ~1 in 4 processes run the default w4a16 step
# 0.05-0.06 ms slower (2.40-2.41 against 2.33-2.36 ms, BENCHMARKS runs 133-139)? Ten processes, each
# calibrating afresh into its own plan directory (SALASERVE_PLAN_CACHE=$OUT/plansN, as run 135); then the
# slowest and the fastest plans reloaded twice each by fresh processes, interleaved. If the slow plan stays
# slow, the calibration's picks are the cause (diff the plan files); if not, the process or the machine.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
step() {  # step PLAN_DIR_INDEX -> prints the step's ms
  SALASERVE_PLAN_CACHE=$OUT/plans$1 timeout 200 python3 -m salaserve.bench.profile_step --graph --context 4096 \
    --quantization w4a16 --top 8 2>&1 | grep -v -i warn | tee -a "$OUT/step-plans$1.log" \
    | sed -n 's/.*graph replay: \([0-9.]*\) ms.*/\1/p'
}
: > "$OUT/fresh.txt"
for i in $(seq 1 10); do echo "$i $(step "$i")" | tee -a "$OUT/fresh.txt"; done
slow=$(sort -k2 -n "$OUT/fresh.txt" | tail -1 | cut -d' ' -f1)
fast=$(sort -k2 -n "$OUT/fresh.txt" | head -1 | cut -d' ' -f1)
for i in "$slow" "$fast" "$slow" "$fast"; do echo "reloaded plans$i: $(step "$i") ms"; done
