#!/usr/bin/env bash
# Run 120 (twenty-third session, at 3-element configs and the then SALASERVE_W4_TMA_GROUP switch): which w4_tma launches fault, then the A/B. Runs 117-118: every
# launch tried failed with "misaligned address" (config (128, 4, 4) at N 4096 / 8704 / 16384, PDL on and
# off). Each variant in its own process (a CUDA fault is sticky), synchronous: the scales and zeros
# through TMA or plain loads (SALASERVE_W4_TMA_GROUP=1/0), every config. Suspects: the small TMA boxes
# (zeros [1, BLOCK_N / 8], one stage in the TTGIR) or a box row wider than the 128-byte swizzle.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
for g in 0 1; do
  for i in 0 1 2 3 4 5 6; do
    SALASERVE_W4_TMA_GROUP=$g CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 - "$i" <<'PY' 2>&1 | grep "^tma" | tee -a "$OUT/w4-tma-faults.log"
import os, sys
import torch
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.quant_gemm import w4_tma as T
from salaserve.quant import rtn
from salaserve.quant.matmul import linear_ref
cfg = T.W4_TMA_CONFIGS[int(sys.argv[1])]
w = rtn.quantize_w4a16_rtn(torch.randn(4096, 4096, device="cuda") * 4096 ** -0.5, 128)
x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
xq, xs = Q.round_x_int16(x)
try:
    y = T.w4a16_gemv_tma(xq, xs, w, config=cfg, split_k=2)
    torch.cuda.synchronize()
    ref = linear_ref(x.float(), w)
    print(f"tma group={os.environ['SALASERVE_W4_TMA_GROUP']} #{sys.argv[1]} {cfg}: ok, rel err {float((y.float() - ref).norm() / ref.norm()):.1e}")
except Exception as e:
    print(f"tma group={os.environ['SALASERVE_W4_TMA_GROUP']} #{sys.argv[1]} {cfg}: FAIL {str(e)[:80]}")
PY
  done
done
# then the A/B (run 117's, which never got to its numbers) on the form that launched correctly, if one did
for g in 0 1; do
  ok=$(grep "group=$g .*: ok" "$OUT/w4-tma-faults.log" | sed 's/.*#\([0-9]*\) .*/\1/' | paste -sd,)
  if [ -n "$ok" ]; then
    SALASERVE_W4_TMA_GROUP=$g timeout 300 python3 scripts/w4_tma_ab.py --configs "$ok" --json "$OUT/w4-tma-ab-group$g.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/w4-tma-ab-group$g.log"
    break
  fi
done
