#!/usr/bin/env bash
# One device call after the fp8 store-kernel and w8a8 fixes: GPU tests (fp8 KV, quant), the
# per-linear table at M = 1 (w8a16 vs w8a8), fp8-KV decode at 4K/128K + 32K prefill, and fp8
# weights decode with SALASERVE_FP8_DECODE=w8a8. Timeouts $1..$4 (0 skips). Logs in $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout "${1:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kv_fp8.py tests/test_gpu_quant.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
[ "${2:-150}" = 0 ] || timeout "${2:-150}" python3 -m salaserve.kernels.bench_quant --m 1 --no-prefill \
  --json "$OUT/bench-quant.json" 2>&1 | grep -v -i warn | tee "$OUT/bench-quant.log" | grep -v "^  w8a8\|^  w4" | tail -9
[ "${3:-150}" = 0 ] || timeout "${3:-150}" python3 -m salaserve.bench.micro --kv-cache-dtype fp8_e4m3 \
  --contexts 4096,131072 --batches 1 --prefill 32768 --max-kv-gib 30 --json "$OUT/micro-kv-fp8.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/micro-kv-fp8.log" | tail -7
[ "${4:-150}" = 0 ] || SALASERVE_FP8_DECODE=w8a8 timeout "${4:-150}" python3 -m salaserve.bench.micro --quantization fp8 \
  --contexts 4096 --batches 1,8 --prefill 8192 --max-kv-gib 20 --json "$OUT/micro-fp8-w8a8.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/micro-fp8-w8a8.log" | tail -7
