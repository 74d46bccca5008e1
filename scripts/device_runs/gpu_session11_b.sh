#!/usr/bin/env bash
# Eleventh session, second part: the fused prefill top-k on the GPU, the sparse prefill kernels'
# launch options (scripts/sparse_launch_ab.py), then the 128K prefill with the defaults, with the
# A/B's best options, and with those plus bf16 GLA inputs.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export TRITON_CACHE_DIR=$PWD/.triton-cache
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --tb=short tests/test_kernels_sparse.py \
  -k "topk_blocks or prefill_topk" 2>&1 | tee "$OUT/gpu_tests.log" | tail -2
timeout 180 python3 scripts/sparse_launch_ab.py --env "$OUT/best.env" 2>&1 | tee "$OUT/sparse_launch_ab.log" \
  | grep -v -i warn | tail -20
run_micro() {  # name, then env assignments
  local name=$1; shift
  env "$@" timeout 130 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill 131072 \
    --prefill-repeats 2 --json "$OUT/micro-128k-$name.json" 2>&1 | grep -v -i warn | tail -2
}
run_micro default SALASERVE_FUSED_PREFILL_TOPK=0
best=$(sed -n 's/^export //p' "$OUT/best.env" 2>/dev/null | tr '\n' ' ')
echo "best: $best"
run_micro best-topk $best
run_micro best-topk-glabf16 $best SALASERVE_GLA_INPUT=bf16
