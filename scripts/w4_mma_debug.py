"""Every config of the int4 mma decode GEMV (quant_gemm/w4_mma.py) at qkvg's shape, 1 and 8 rows,
splits 1 and 8, with PDL off and on, against dequantize-then-matmul: relative error and the first
wrong outputs (GPU only). Written to find run 90's wrong sums at 2+ row tiles per warp.

    python scripts/w4_mma_debug.py
"""
import torch
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels import _triton_utils as U
from salaserve.quant import rtn
from salaserve.quant.matmul import linear_ref
N, K = 8704, 4096
w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
mma = Q.repack_w4_for_mma(w)
for pdl in (False, True):
    U.set_pdl(pdl)
    for M in (1, 8):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ref = linear_ref(x, w).float()
        for cfg in Q.W4_MMA_CONFIGS:
            for split in (1, 8):
                y = Q.w4a16_gemv_mma(x, w, mma, config=cfg, split_k=split).float()
                torch.cuda.synchronize()
                err = (y - ref).abs()
                rel = float((y - ref).norm() / ref.norm())
                bad = (err > 0.05 * ref.abs().max()).nonzero()
                print(f"pdl={pdl} M={M} {cfg} split {split}: rel {rel:.2e}, bad {len(bad)}", bad[:4].tolist() if len(bad) else "")
