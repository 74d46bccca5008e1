#!/usr/bin/env bash
# Twentieth session, NOT RUN (device time spent): decode at 4K with lm_head quantized on load
# (--quantize-lm-head, the issue's 3.2x row), w4a16 and fp8, against plain w4a16 and bf16 in the same
# call. Prediction (perf-notes, twentieth session): lm_head ~0.15 -> ~0.06 ms at batch 1, w4a16
# 2.59 -> ~2.5 ms (~1.93x bf16), far from 3.2x.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
decode_4k w4a16-lmhead 380 4 --quantization w4a16 --quantize-lm-head
decode_4k bf16 180 3
