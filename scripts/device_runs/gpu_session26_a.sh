#!/usr/bin/env bash
# Twenty-sixth session: are the slow w4a16 processes (2.40-2.41 against 2.33-2.36 ms, BENCHMARKS runs 133-139)
# the ones that compiled their own kernels? Runs 134, 137 and 139 (all slow) each ran the dp2a kernels
# right after compiling them (changed kernel source or a cold machine); run 135's and 138's processes,
# all on a warm Triton cache, were all fast. Six processes, each with its own plan directory and a
# Triton cache dir chosen to make it cold or warm:
#   p1 cache A empty, calibrates (precompile in threads)     p2 cache A warm, calibrates
#   p3 cache B empty, loads p1's plan (compiles at launch)   p4 cache C empty, calibrates
#   p5 cache A warm, loads p1's plan (run before p4)
# Slow p1/p4 and fast p2/p5: compiling in the process is the cause (p3 says whether precompile's
# threads are needed for it); slow p1 and p5 alike: p1's plan. GPU clocks are logged before each.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
T=/tmp/tc; rm -rf "$T"; mkdir -p "$T"
step() {  # step NAME CACHE PLAN_DIR -> one line: name, graph replay ms, start-up
  local name=$1 cache=$2 plans=$3
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/clocks.txt"
  TRITON_CACHE_DIR=$T/$cache SALASERVE_PLAN_CACHE=$OUT/$plans timeout 330 python3 -m salaserve.bench.profile_step \
    --graph --context 4096 --quantization w4a16 --top 8 --json "$OUT/$name.json" 2>&1 | grep -v -i warn \
    > "$OUT/$name.log"
  echo "$name cache=$cache plans=$plans: $(sed -n 's/.*graph replay: \([0-9.]*\) ms.*/\1 ms/p' "$OUT/$name.log") \
| $(grep -m1 -i 'start-up' "$OUT/$name.log" | cut -c1-150)"
}
step p1 A plans1
step p2 A plans2
cp -r "$OUT/plans1" "$OUT/plans3"
step p3 B plans3
step p5 A plans1
step p4 C plans4   # last: a cold calibration may not fit the call's 600 s
cat "$OUT/clocks.txt"
