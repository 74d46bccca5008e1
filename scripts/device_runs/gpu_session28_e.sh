#!/usr/bin/env bash
# Twenty-eighth session (run 151 in the twenty-ninth): fp16 dot operands in the block-sparse prefill's per-token
# kernel on fp8 KV pages (sparse.attention.SPARSE_FP8_F16_DOTS, SALASERVE_SPARSE_FP8_F16_DOTS=1, off by default).
# A 32K prefill on fp8 pages was 8% slower than on bf16 pages (BENCHMARKS run 8: 1.42 against 1.31 s).
# Prediction (docs/perf-notes.md, twenty-eighth session): the per-token kernel's total on fp8 pages 10-20%
# lower with F16 dots; if the occupancy loss (4 -> 3 programs per SM) dominates, higher instead.
# GPU tests first (the new "sparse" kind: the window and per-token kernels on fp8 pages against bf16 pages
# holding the dequantized values, F16 dots off and on), then one profile_step --prefill process per variant.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py 2>&1 | grep -E "^sparse|decode f16|passed|failed|Error" | tail -12
prefill_profile prefill-bf16-pages
SALASERVE_SPARSE_FP8_STAGED=0 prefill_profile prefill-fp8-pages --kv-cache-dtype fp8_e4m3
SALASERVE_SPARSE_FP8_F16_DOTS=1 SALASERVE_SPARSE_FP8_STAGED=0 prefill_profile prefill-fp8-pages-f16 --kv-cache-dtype fp8_e4m3
