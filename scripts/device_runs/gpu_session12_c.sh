#!/usr/bin/env bash
# Twelfth session, third call: the stage-1 keys kernel with its C1 load and dot outside the
# interior/masked branch (pipelined), and the per-token attention reading pages from a list:
# GPU tests, kernel-level A/B (scripts/sparse_launch_ab.py), then the 128K prefill in one process.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 $GPU_PYTEST tests/test_kernels_sparse.py -k "selection or sparse_attention" 2>&1 | tee "$OUT/sparse.log" \
  | grep -E "passed|failed|Error" | tail -6
timeout 150 python3 scripts/sparse_launch_ab.py 2>&1 | tee "$OUT/sparse_launch_ab.log" | grep -v -i warn | tail -22
timeout 260 python3 scripts/prefill_ab.py --reps 3 --json "$OUT/prefill_ab.json" \
  --variants "8192:bf16,8192:bf16:0/2/128,8192:bf16::1" 2>&1 | tee "$OUT/prefill_ab.log" | grep -v -i warn | tail -6
