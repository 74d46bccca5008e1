#!/usr/bin/env bash
# Twentieth session, NOT RUN (device time spent): the GPU checks and A/B of the dp2a kernel's silu_mul
# epilogue (SALASERVE_W4_SILU_EPILOGUE=1, opt-in until this runs) and of lm_head quantized on load
# (--quantize-lm-head, the issue's 3.2x row). Start-up from run 100's plan where its fingerprint holds.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 200 $GPU_PYTEST tests/test_gpu_quant.py -k "dp2a_every_config and gate_up" 2>&1 | tail -4 | tee "$OUT/pytest-dp2a-silu.log"
SALASERVE_W4_SILU_EPILOGUE=1 timeout 330 $GPU_PYTEST tests/test_gpu_engine.py -k "w4a16_decode_batches" 2>&1 \
  | grep -E "picks|rel err|passed|failed|Error|assert" | tee "$OUT/pytest-engine-silu.log"
# (a second call) decode at 4K, batch 1: the epilogue on and off, lm_head quantized, bf16
# decode_4k w4a16-silu 380 4 --quantization w4a16   (with SALASERVE_W4_SILU_EPILOGUE=1)
# decode_4k w4a16 380 4 --quantization w4a16
# decode_4k w4a16-lmhead 380 4 --quantization w4a16 --quantize-lm-head
# decode_4k bf16 180 3
