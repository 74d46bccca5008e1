#!/usr/bin/env bash
# Twentieth session, NOT RUN: where the w4a16 step's ~0.6 ms outside its linears goes (bf16's is
# ~0.3). Kernel timelines of the batch-1 decode graph at 4K without PDL (kernel times that do not
# overlap; the step itself is slower without PDL), w4a16 then bf16, kernels by total time.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for q in w4a16 bf16; do
  arg=""; [ "$q" = bf16 ] || arg="--quantization $q"
  SALASERVE_PDL=0 timeout 380 python3 -m salaserve.bench.profile_step --graph --context 4096 $arg --top 30 \
    --json "$OUT/graph-profile-$q-nopdl.json" 2>&1 | grep -v -i warn | tee "$OUT/graph-profile-$q-nopdl.log" | head -34
done
