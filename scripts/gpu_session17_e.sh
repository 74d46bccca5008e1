#!/usr/bin/env bash
# Seventeenth session, last device call: the int4 FMA GEMV's stream configs against its register-
# prefetch ones at one row (each checked against dequantize-then-matmul first), then w4a16 and
# bf16 decode at 4K (the w4 calibration now includes the stream configs; its start-up is long with
# a cold kernel cache: 243.6 s in run 77).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 170 python3 scripts/w4_gemv_ab.py "$OUT/w4-ab.json" 2>&1 | grep -v -i warn | tee "$OUT/w4-ab.log" | tail -9
decode_4k w4a16 320 4 --quantization w4a16
decode_4k bf16 90 3
