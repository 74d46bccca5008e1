#!/usr/bin/env bash
# For the third GPU call after the thirteenth session: the quantized kernels' GPU tests after
# kernels/quant_gemm.py became a package (sm_90 SASS of its compiled kernels unchanged, checked on
# the CPU), and the sampler's CUDA test (logit_bias is new).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 300 $GPU_PYTEST tests/test_gpu_quant.py tests/test_sampler.py 2>&1 | tee "$OUT/quant.log" \
  | grep -E "passed|failed|Error" | tail -12
