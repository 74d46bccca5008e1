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
step() {  # step NAME ARGS...: the GPU clocks, then one profile_graph process
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/clocks.txt"
  profile_graph "$@"
}
step w4-first --context 4096 --quantization w4a16
step kv-bf16-1 --context 131072
step kv-fp8-1 --context 131072 --kv-cache-dtype fp8_e4m3
step kv-bf16-2 --context 131072
step kv-fp8-2 --context 131072 --kv-cache-dtype fp8_e4m3
step w4-after-bf16 --context 4096 --quantization w4a16
cat "$OUT/clocks.txt"
