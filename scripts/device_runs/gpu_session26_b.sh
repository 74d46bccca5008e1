#!/usr/bin/env bash
# Twenty-sixth session, two questions in one call (fresh machine):
# 1. Issue 7's fp8 KV criterion with today's kernels: is a batch-1 decode step at 128K on fp8 pages no
#    slower than on bf16 pages? (Last measured in runs 6 and 8, eager micro: 5.881 vs 5.849 ms.) bf16
#    weights as there; graph replays; the two KV dtypes interleaved over four processes.
# 2. Run 140 found cold compiles fast. The slow w4a16 processes (runs 134, 137, 139) each followed another
#    kind of GPU process in the same call (GPU tests, a bf16 step). So: a w4a16 step first, then after
#    the four bf16 processes, again.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
step() {  # step NAME ARGS... -> one line with the graph replay
  local name=$1; shift
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/clocks.txt"
  timeout 200 python3 -m salaserve.bench.profile_step --graph --top 12 --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v -i warn > "$OUT/$name.log"
  echo "$name ($*): $(sed -n 's/.*graph replay: \([0-9.]*\) ms.*/\1 ms/p' "$OUT/$name.log")"
}
step w4-first --context 4096 --quantization w4a16
step kv-bf16-1 --context 131072
step kv-fp8-1 --context 131072 --kv-cache-dtype fp8_e4m3
step kv-bf16-2 --context 131072
step kv-fp8-2 --context 131072 --kv-cache-dtype fp8_e4m3
step w4-after-bf16 --context 4096 --quantization w4a16
cat "$OUT/clocks.txt"
