#!/usr/bin/env bash
# Eighteenth session, run 88: the int4 mma GEMV with x loads masked past M; ncu of one launch each
# (gate_up), then the calibration's candidates at the model's shapes.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 200 ncu --kernel-name regex:w4_ --launch-skip 0 --section SpeedOfLight --section WarpStateStats \
  --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats \
  python3 scripts/w4_mma_ncu.py > "$OUT/ncu.txt" 2>&1
grep -E "w4_|Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|L1/TEX Hit|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Stall Long|Issued Warp|Block Limit Shared|Shared Memory Configuration Size|Dynamic Shared" "$OUT/ncu.txt" | grep -v "^==PROF==" | head -120
timeout 300 python3 scripts/w4_candidates.py --m 1 8 --json "$OUT/w4-candidates.json" 2>&1 | grep -v -i warn | tee "$OUT/w4-candidates.log"
