#!/usr/bin/env bash
# Thirtieth session, call C: the 27 `sweep` GPU tests of the quantized kernels that run 158 did not reach
# (sweep_rest_30.txt; the first 7 passed there). They are compile-bound (every config of a shape compiled
# cold), so they run as 8 pytest processes side by side on the one GPU, round-robin over the node ids.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
ids=$(dirname "$0")/sweep_rest_30.txt
for s in 0 1 2 3 4 5 6 7; do
  awk -v s=$s 'NR % 8 == s' "$ids" > /tmp/shard$s.txt
  timeout 540 $GPU_PYTEST $(cat /tmp/shard$s.txt) > "$OUT/sweep-shard$s.log" 2>&1 &
done
wait
for s in 0 1 2 3 4 5 6 7; do echo "shard $s: $(wc -l < /tmp/shard$s.txt) ids: $(grep -E '^(=+ )?[0-9]+ (passed|failed)|passed|failed|error' "$OUT/sweep-shard$s.log" | tail -1)"; done
grep -h -E "^(FAILED|ERROR)" "$OUT"/sweep-shard*.log | head -20
