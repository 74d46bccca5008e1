"""Reference (pure torch) quantized matmuls: the ground truth the Triton kernels are tested against.

All compute in fp32 from exactly dequantized weights and return x's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from salaserve.quant.formats import GPTQ_V1, QuantizedLinearWeights, dequantize_fp8, dequantize_gptq


def w4a16_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor] = None,
    group_size: int = 128,
    fmt: str = GPTQ_V1,
    perm: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(W)^T -> [M, N]. perm: qweight row k holds input channel perm[k]."""
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, group_size, fmt)  # [N, K] fp32
    xf = x.float() if perm is None else x.float()[:, perm.long()]
    return (xf @ w.t()).to(x.dtype)


def fp8_matmul_ref(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (w_fp8 [N, K] * scale [N, 1])^T -> [M, N] (weight-only fp8, w8a16)."""
    return (x.float() @ dequantize_fp8(w_fp8, scale).t()).to(x.dtype)


def linear_ref(x: torch.Tensor, w: QuantizedLinearWeights) -> torch.Tensor:
    """y = x @ W^T for any container format, x [..., K] -> [..., N]."""
    return (x.float() @ w.dequantize(torch.float32).t()).to(x.dtype)
