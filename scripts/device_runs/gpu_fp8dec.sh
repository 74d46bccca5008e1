#!/usr/bin/env bash
# One device call: the w8a8 fp8 decode GEMV. GPU quant tests, the per-linear table at M = 1 and 8
# (w8a16 vs w8a8), batch-1/8 decode with fp8 weights (w8a8 by default), and the graph-replay
# kernel timeline of a 4K decode step with fp8 KV pages. Timeouts: $1 tests, $2 bench_quant,
# $3 micro, $4 profile (0 skips). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_quant.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
[ "${2:-150}" = 0 ] || timeout "${2:-150}" python3 -m salaserve.kernels.bench_quant --m 1 8 --no-prefill \
  --json "$OUT/bench-quant.json" 2>&1 | grep -v -i warn | tee "$OUT/bench-quant.log" | grep -v "^  w8a8\|^  w4" | tail -14
[ "${3:-160}" = 0 ] || timeout "${3:-160}" python3 -m salaserve.bench.micro --quantization fp8 --contexts 4096 \
  --batches 1,8 --prefill 32768 --max-kv-gib 20 --json "$OUT/micro-fp8.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/micro-fp8.log" | tail -7
[ "${4:-120}" = 0 ] || timeout "${4:-120}" python3 -m salaserve.bench.profile_step --graph --context 4096 --top 16 \
  --kv-cache-dtype fp8_e4m3 --json "$OUT/graph-profile-kvfp8.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/graph-profile-kvfp8.log" | tail -30
