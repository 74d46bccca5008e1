#!/usr/bin/env bash
# For the second GPU call after the thirteenth session: the engine's parity tests (the new prompt
# logprobs test included: never run on a GPU yet) after the sparse and quant_gemm packages, then
# the 4K decode and 128K prefill micro.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 300 $GPU_PYTEST tests/test_gpu_engine.py 2>&1 | tee "$OUT/engine.log" | grep -E "rel err|passed|failed|Error" | tail -24
timeout 150 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill 131072 \
  --prefill-repeats 2 --json "$OUT/micro.json" 2>&1 | tee "$OUT/micro.log" | grep -v -i warn | tail -6
