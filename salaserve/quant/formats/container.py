"""QuantizedLinearWeights: what the engine's linear layer holds, in any registered format.

The container is the same for every format: `format` names a registered Format (registry.py), which
gives the meaning of the tensor fields it uses and does the work (dequantize, concat, checkpoint
tensors). A format uses the fields it needs:

    format "bf16":  weight [N, K] (any float dtype; bf16 in the engine)
    format "fp8":   weight float8_e4m3fn [N, K], scale fp32 [N]
    format "w4a16": qweight, qzeros (v2: true zeros), scales, g_idx as in formats/w4a16.py;
                    perm (optional, see w4a16.reorder_act_order): qweight row k' holds input
                    channel perm[k'], so kernels read x[:, perm]; g_idx is then given in that order
    weight-only formats made on load (the Format defaults): weight [N, K] and a per-row scale [N]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from salaserve.quant.formats.base import GPTQ_V1
from salaserve.quant.formats.registry import get


@dataclass
class QuantizedLinearWeights:
    """y = x @ W^T with W [out_features, in_features], stored in `format` (module docstring)."""

    format: str
    in_features: int
    out_features: int
    weight: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    qweight: Optional[torch.Tensor] = None
    qzeros: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None
    g_idx: Optional[torch.Tensor] = None
    group_size: int = 128
    perm: Optional[torch.Tensor] = None
    g_idx_trivial: bool = True  # cached so that kernels pick their fast path without a device sync
    # w4a16 on the GPU: the wgmma decode kernel's repacked copy (quant_gemm.w4_wgmma.W4WgmmaWeights),
    # attached at start-up by TritonBackend.prepare_weights; None elsewhere
    wgmma: Optional[object] = None
    # w4a16 on the GPU: an fp8 copy (format "fp8", from the dequantized int4 weights) that inputs past
    # the int4 decode kernels' rows meet instead (w8a16 up to 64 rows, w8a8 on fp8 tensor cores above;
    # quant_gemm.dispatch.FP8_COPY_ABOVE_ROWS, fp8.fp8_prefill_copy, KernelOptions.w4a16_prefill); None elsewhere
    prefill: Optional["QuantizedLinearWeights"] = None
    # fp8: prefill-sized inputs quantized per token too (w8a8), as GPUs with fp8 tensor cores serve them;
    # the reference linear follows it (fp8.takes_w8a8). Set on prefill copies, and where a run models
    # such a GPU (the quality tool on the CPU); False: weight-only math at every size
    w8a8: bool = False

    def __post_init__(self):
        get(self.format)  # a registered format, or ValueError

    # -- constructors of the built-in formats
    @classmethod
    def from_dense(cls, w: torch.Tensor) -> "QuantizedLinearWeights":
        return cls("bf16", w.shape[1], w.shape[0], weight=w)

    @classmethod
    def from_fp8(cls, w8: torch.Tensor, scale: torch.Tensor) -> "QuantizedLinearWeights":
        return cls("fp8", w8.shape[1], w8.shape[0], weight=w8, scale=scale.float())

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: Optional[torch.Tensor] = None, group_size: int = 128,
                  fmt: str = GPTQ_V1) -> "QuantizedLinearWeights":
        """From GPTQ checkpoint tensors; qzeros in `fmt` (default "gptq" = v1) are stored as v2."""
        return get("w4a16").from_gptq(qweight, qzeros, scales, g_idx, group_size, fmt)

    # -- views
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in the original input-channel order."""
        return get(self.format).dequantize(self, dtype)

    def to_checkpoint(self, fmt: str = GPTQ_V1) -> dict[str, torch.Tensor]:
        """w4a16 tensors as a GPTQ checkpoint stores them (qzeros in `fmt`)."""
        if self.format != "w4a16":
            raise ValueError("to_checkpoint is for w4a16 weights")
        return get("w4a16").gptq_tensors(self, fmt)

    def to(self, device) -> "QuantizedLinearWeights":
        moved = {
            f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name))
            for f in dataclasses.fields(self)
        }
        moved["wgmma"] = moved["prefill"] = None  # kernels' copies for the old device; rebuilt where used
        return QuantizedLinearWeights(**moved)

    def nbytes(self) -> int:
        extra = (self.wgmma.qweight, self.wgmma.zs) if self.wgmma is not None else ()
        extra += (self.prefill.weight, self.prefill.scale) if self.prefill is not None else ()
        return sum(
            t.numel() * t.element_size()
            for t in (self.weight, self.scale, self.qweight, self.qzeros, self.scales, self.g_idx, self.perm, *extra)
            if t is not None
        )

    # -- fusion
    @staticmethod
    def concat(parts: Sequence["QuantizedLinearWeights"]) -> "QuantizedLinearWeights":
        """Concatenate along the output dim (fused qkv / gate_up). Parts share K and format, and the
        format must take them together (Format.fusable: int4 parts share group_size, g_idx and perm)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        first = parts[0]
        for p in parts:
            if p.format != first.format or p.in_features != first.in_features:
                raise ValueError("concatenated weights must share format and in_features")
        return get(first.format).concat(list(parts))

    def fusable_with(self, other: "QuantizedLinearWeights") -> bool:
        """Whether `other` may be concatenated after this weight (QuantizedLinearWeights.concat)."""
        return (self.format == other.format and self.in_features == other.in_features
                and get(self.format).fusable(self, other))
