#!/usr/bin/env bash
# Fourteenth session, last GPU call: the prefix cache on the GPU engine (full shapes, dummy
# weights, CUDA graphs) and the structured-output test after its fix.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 200 $GPU_PYTEST tests/test_gpu_engine.py -k "prefix_cache or structured" 2>&1 | tee "$OUT/engine.log" \
  | grep -E "rel err|structured|passed|failed|Error" | tail -8
