#!/usr/bin/env bash
# Twenty-seventh session: fp8 against bf16 KV pages in one process (profile_step --ab-kv-cache, as run 145) with
# the fp8 decode's codes converted in registers (DECODE_FP8_REG_CVT=1). Run 145: +0.009 ms at 131080, +0.032 at
# 131103. Prediction: 131080 within +-0.004; 131103 about +0.025 (the compressed-key update is unchanged).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_FP8_KV_REG_CVT=1
PROFILE_TIMEOUT=540 profile_graph ab-kv-regcvt --context 131080,131103 --ab-kv-cache --rounds 7
grep -E "median" "$OUT/ab-kv-regcvt.log"
