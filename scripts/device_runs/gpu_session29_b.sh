#!/usr/bin/env bash
# Twenty-ninth session: the sparse prefill on fp8 pages with the pages dequantized once per layer
# (sparse.attention.SPARSE_FP8_STAGED, SALASERVE_SPARSE_FP8_STAGED=1). Run 151: the per-token kernel 225.5 ms on
# fp8 pages against 124.0 on bf16 pages in a 32K prefill. Prediction (docs/perf-notes.md, twenty-ninth session):
# staged 225 -> ~124-126 ms, window kernel 44 -> ~28-29, the prefill's kernels 1.194 -> ~1.09 s.
# GPU test first (kind "sparse": the staged path bit-equal to bf16 pages holding the dequantized values). The staged
# copy is the default since run 152, so the in-kernel variant sets SALASERVE_SPARSE_FP8_STAGED=0 (run 152 ran
# before that, when 0 was the default).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py -k "sparse or prefill" 2>&1 | grep -E "^sparse|passed|failed|Error" | tail -8
SALASERVE_SPARSE_FP8_STAGED=0 prefill_profile prefill-fp8-pages --kv-cache-dtype fp8_e4m3
SALASERVE_SPARSE_FP8_STAGED=1 prefill_profile prefill-fp8-pages-staged --kv-cache-dtype fp8_e4m3
prefill_profile prefill-bf16-pages
