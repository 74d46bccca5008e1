"""One call each of the int4 decode kernels at gate_up's shape (M = 1 and 8), for a profiler run:
    ncu --kernel-name regex:w4_ --launch-skip 0 python scripts/w4_mma_ncu.py
(the mma kernel at two configs, the FMA kernel at one row; the first call of each compiles)."""

import torch

from salaserve.kernels import quant_gemm as Q
from salaserve.quant import rtn

N, K = 32768, 4096
w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
packed = Q.repack_w4_for_mma(w)
for m in (1, 8):
    x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
    for _ in range(2):
        Q.w4a16_gemv_mma(x, w, packed, config=(4, 4, 3), split_k=4)
        Q.w4a16_gemv_mma(x, w, packed, config=(2, 8, 4), split_k=4)
        if m == 1:
            Q.w4a16_gemv_fma(x, w, config=(128, 8, 4, 2), split_k=8)
torch.cuda.synchronize()
