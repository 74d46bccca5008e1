#!/usr/bin/env bash
# For the first GPU call after the thirteenth session (which had no device time): the sparse
# kernels' GPU tests after kernels/sparse.py became a package (sm_90 SASS of every compiled kernel
# unchanged, checked on the CPU), then the tile kernel against list overlap
# (scripts/sparse_overlap_ab.py, never run yet; the prediction is in docs/perf-notes.md).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 200 $GPU_PYTEST tests/test_kernels_sparse.py tests/test_kv_fp8.py 2>&1 | tee "$OUT/sparse.log" \
  | grep -E "passed|failed|Error" | tail -12
timeout 300 python3 scripts/sparse_overlap_ab.py --reps 10 2>&1 | tee "$OUT/overlap.log" | grep -v -i warn | tail -12
