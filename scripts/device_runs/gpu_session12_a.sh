#!/usr/bin/env bash
# Twelfth session, first call: the GPU tests the eleventh session left unrun (the engine and the
# sparse kernels at the new sparse prefill defaults: 8x16 stage-1 tile, register caps, fused
# top-k), then the engine's parity tests with bf16 GLA inputs (SALASERVE_GLA_INPUT=bf16).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export TRITON_CACHE_DIR=$PWD/.triton-cache
PYT="python3 -m pytest -m gpu -q -s -p no:cacheprovider -rfE --tb=short"
timeout 230 $PYT tests/test_gpu_engine.py 2>&1 | tee "$OUT/engine.log" | grep -E "rel err|passed|failed|Error" | tail -30
SALASERVE_GLA_INPUT=bf16 timeout 150 $PYT tests/test_gpu_engine.py -k "matches_reference or chunked" 2>&1 \
  | tee "$OUT/engine-glabf16.log" | grep -E "rel err|passed|failed|Error" | tail -12
timeout 170 $PYT tests/test_kernels_sparse.py 2>&1 | tee "$OUT/sparse.log" | grep -E "passed|failed|Error" | tail -12
