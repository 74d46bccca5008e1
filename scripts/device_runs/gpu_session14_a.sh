#!/usr/bin/env bash
# Fourteenth session, first GPU call: the kernel-level GPU tests after kernels/sparse.py and
# kernels/quant_gemm.py became packages (sm_90 SASS unchanged, checked on the CPU) and the
# sampler's CUDA test (logit_bias is new in the thirteenth session).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 240 $GPU_PYTEST tests/test_kernels_sparse.py tests/test_kv_fp8.py 2>&1 | tee "$OUT/sparse.log" \
  | grep -E "passed|failed|Error" | tail -8
timeout 300 $GPU_PYTEST tests/test_gpu_quant.py tests/test_sampler.py 2>&1 | tee "$OUT/quant.log" \
  | grep -E "passed|failed|Error" | tail -8
