"""Round-to-nearest quantization: the int4 grid shared with GPTQ, RTN w4a16, and fp8.

The int4 grid follows GPTQ's quantizer so both produce the same kind of checkpoint:
  asymmetric: scale = (max(x, 0) - min(x, 0)) / 15, zero = round(-min / scale)
  symmetric:  scale = 2 * amax / 15, zero = 8
  code q = clamp(round(x / scale) + zero, 0, 15), value = (q - zero) * scale
Scales are rounded to their storage dtype (fp16, as GPTQ checkpoints keep them) *before* the codes
are chosen, so the codes are the best ones for the scales actually stored.
"""

from __future__ import annotations

import torch

from salaserve.quant.formats import (
    QuantizedLinearWeights,
    pack_int4,
    pack_zeros,
    quantize_fp8_per_channel,
    trivial_g_idx,
    GPTQ_V2,
)

MAXQ = 15


def find_params(x: torch.Tensor, sym: bool = True, scale_dtype: torch.dtype = torch.float16):
    """Per-row grid for x [rows, cols] -> (scale fp32 [rows], zero fp32 [rows], integer-valued)."""
    x = x.float()
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    flat = (xmax - xmin) == 0  # an all-zero row still needs a usable grid
    xmin = torch.where(flat, -torch.ones_like(xmin), xmin)
    xmax = torch.where(flat, torch.ones_like(xmax), xmax)
    scale = ((xmax - xmin) / MAXQ).to(scale_dtype).float()
    if sym:
        zero = torch.full_like(scale, (MAXQ + 1) // 2)
    else:
        zero = torch.round(-xmin / scale).clamp(0, MAXQ)
    return scale, zero


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] with per-row scale/zero [rows] -> integer codes (float tensor) in 0..15."""
    return torch.clamp(torch.round(x.float() / scale[:, None]) + zero[:, None], 0, MAXQ)


def quantize_w4a16_rtn(
    w: torch.Tensor, group_size: int = 128, sym: bool = True, scale_dtype: torch.dtype = torch.float16
) -> QuantizedLinearWeights:
    """W [N, K] -> w4a16 weights (GPTQ layout, trivial g_idx) by round-to-nearest per group."""
    N, K = w.shape
    gs = K if group_size <= 0 else group_size
    G = (K + gs - 1) // gs
    q = torch.empty(N, K, dtype=torch.uint8, device=w.device)
    scales = torch.empty(G, N, dtype=scale_dtype, device=w.device)
    zeros = torch.empty(G, N, dtype=torch.uint8, device=w.device)
    for g in range(G):
        cols = slice(g * gs, min((g + 1) * gs, K))
        s, z = find_params(w[:, cols], sym, scale_dtype)
        q[:, cols] = quantize_codes(w[:, cols], s, z).to(torch.uint8)
        scales[g], zeros[g] = s.to(scale_dtype), z.to(torch.uint8)
    return QuantizedLinearWeights.from_gptq(
        pack_int4(q.t()), pack_zeros(zeros, GPTQ_V2), scales, trivial_g_idx(K, gs, w.device), gs, GPTQ_V2
    )


def quantize_fp8(w: torch.Tensor) -> QuantizedLinearWeights:
    """W [N, K] -> fp8 e4m3 weights with one fp32 scale per output channel."""
    return QuantizedLinearWeights.from_fp8(*quantize_fp8_per_channel(w))
