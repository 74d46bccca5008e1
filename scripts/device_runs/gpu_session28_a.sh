#!/usr/bin/env bash
# RUN (146 / 147); DECODE_FP8_REG_CVT, DECODE_FP8_STAGES and decode_fp8_compile_stats.py were removed after these
# runs (slower, see BENCHMARKS.md): to run again, check out ec528a3 (there gpu_session27_b.sh and _d.sh).
# Twenty-eighth session: fp8 codes converted to fp16 in registers before the decode kernel stages the K/V tile
# in shared memory (attention.DECODE_FP8_REG_CVT): both dots then read fp16 through ldmatrix (.trans for V)
# instead of V's byte-wise shared loads. Run 145 (one process): fp8 pages +0.009 ms against bf16 pages at 131080.
# Prediction (docs/perf-notes.md): REG_CVT 0 -> 1 at 131080: -0.005..-0.010 ms; stages 3 vs 1: within +-0.003.
# GPU tests first (the decode kind checks REG_CVT bit-equal to Triton's cast, at 1 and 3 stages).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
$GPU_PYTEST tests/test_kv_fp8.py 2>&1 | grep -E "decode f16|passed|failed|Error" | tail -12
PROFILE_TIMEOUT=280 profile_graph ab-regcvt-131080 --context 131080 --kv-cache-dtype fp8_e4m3 \
  --ab salaserve.kernels.attention:DECODE_FP8_REG_CVT=0,1 --rounds 7
export SALASERVE_FP8_KV_REG_CVT=1
PROFILE_TIMEOUT=250 profile_graph ab-stages-131080 --context 131080 --kv-cache-dtype fp8_e4m3 \
  --ab salaserve.kernels.attention:DECODE_FP8_STAGES=0,1 --rounds 5
