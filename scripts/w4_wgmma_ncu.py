"""One call each of the int4 decode kernels at gate_up's shape (M = 1 and 8), for a profiler run:
    ncu --kernel-name regex:w4_gemv --launch-skip 0 python scripts/w4_wgmma_ncu.py
"""

import torch

from salaserve.kernels import quant_gemm as Q
from salaserve.quant import rtn

N, K = 32768, 4096
w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
packed = Q.repack_w4_for_wgmma(w)
for m in (1, 8):
    x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
    for _ in range(2):  # the first call compiles
        Q.w4a16_gemv_wgmma(x, w, packed, config=(128, 16, 4, 3), split_k=4)
        if m == 1:
            Q.w4a16_gemv_fma(x, w, config=Q.W4_FMA_CONFIGS[1][0], split_k=8)
torch.cuda.synchronize()
