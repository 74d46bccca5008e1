"""One call each of the fp8 decode GEMVs at gate_up's shape, M = 1 (the mma kernel at its best
run-75 config, n64 split 32, and the FMA GEMV at n4 split 1), for a profiler run:
    ncu --kernel-name regex:"fp8_mma|gemv_kernel" --launch-skip 2 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
        python scripts/fp8_mma_ncu.py
(--launch-skip 2: the first calls compile.)
"""

import torch

from salaserve.kernels import gemv as G
from salaserve.quant import rtn

N, K = 32768, 4096
w = rtn.quantize_fp8(torch.randn(N, K, device="cuda") * K ** -0.5)
x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
mma = G.GemvConfig(64, 64, 4, 1, split_k=32, mma=True)
fma = G.GemvConfig(4, 2048, 4, split_k=1)
for _ in range(2):
    G.gemv_fp8(x, w.weight, w.scale, mma)
    G.gemv_fp8(x, w.weight, w.scale, fma)
torch.cuda.synchronize()
