#!/usr/bin/env bash
# Twenty-third session, call A: does any tensor-descriptor load launch on the device's Triton (runs
# 117-119: every w4_tma launch faulted with "misaligned address")? The minimal probes first
# (scripts/tma_probe.py, one process each), then scripts/device_runs/gpu_session22_e.sh (w4_tma, both forms, every
# config, one launch per process, then the A/B on what launched); the compiled w4_tma kernels' ttgir and
# ptx from the Triton cache go to $OUT/asm for reading here.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
mkdir -p "$OUT/asm"
for p in host1 host_loop host_loop_x device_loop; do
  for bn in 128 32; do
    CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 scripts/tma_probe.py $p --block-n $bn --asm "$OUT/asm" 2>&1 | grep "^probe" | tee -a "$OUT/tma-probe.log"
  done
done
bash scripts/device_runs/gpu_session22_e.sh
for f in $(grep -rl "_w4_gemv_tma_kernel" "$TRITON_CACHE_DIR" --include="*.ttgir" 2>/dev/null | head -4); do
  d=$(dirname "$f"); cp "$d"/*.ttgir "$d"/*.ptx "$d"/*.json "$OUT/asm/" 2>/dev/null
  cp "$d"/_w4_gemv_tma_kernel.ptx "$OUT/asm/w4_tma-$(basename "$d").ptx" 2>/dev/null
  cp "$d"/_w4_gemv_tma_kernel.json "$OUT/asm/w4_tma-$(basename "$d").json" 2>/dev/null
done
ls "$OUT/asm" | head -30
