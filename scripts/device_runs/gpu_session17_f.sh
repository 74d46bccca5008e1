#!/usr/bin/env bash
# Seventeenth session: the plan cache on the GPU. fp8 engine start-up (micro, decode at 4K, batch
# 1) with an empty Triton cache and no plan, then again with another empty Triton cache and the
# plan the first run wrote: the second times nothing and compiles only the picked kernels.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
export SALASERVE_PLAN_CACHE="$OUT/plans"
run() {  # run LABEL TRITON_CACHE TIMEOUT
  TRITON_CACHE_DIR=$2 timeout "$3" python3 -m salaserve.bench.micro --contexts 4096 --batches 1 --prefill "" \
    --quantization fp8 --json "$OUT/micro-$1.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$1.log" | tail -3
}
run noplan /tmp/tc1 135
python3 -c "
import json, glob
for p in glob.glob('$OUT/plans/*.json'):
    d = json.load(open(p)); print(p.split('/')[-1], {k: len(v) for k, v in d['tables'].items()}, d['fingerprint']['gpu'])"
run plan /tmp/tc2 110
