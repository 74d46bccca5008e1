"""The fp8 format: e4m3 weights with one fp32 scale per output channel.

Checkpoint (salaserve's own, quant_method "fp8"): `<linear>.weight` float8_e4m3fn [N, K] and
`<linear>.weight_scale` fp32 [N] (or [N, 1]); W = weight * weight_scale[:, None]. On load a bf16
checkpoint is quantized per channel with scale = amax / 448.

Activations stay in the model dtype at decode sizes (w8a16). On GPUs with fp8 tensor cores, above
W8A8_ABOVE_ROWS rows (prefill) they are quantized per token to e4m3 too (w8a8): `takes_w8a8` says when.
The reference linear follows that split for weights marked `w8a8` (prefill copies of int4 weights, and
fp8 weights where a run models such a GPU), so quality measurements on the CPU see the GPU's numerics.
"""

from __future__ import annotations

import torch

from salaserve.quant.formats.base import Format, QuantConfigError, QuantScheme
from salaserve.quant.formats.container import QuantizedLinearWeights
from salaserve.quant.formats.w4a16 import W4A16

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(w: torch.Tensor) -> QuantizedLinearWeights:
    """W [N, K] -> fp8 e4m3 weights with one fp32 scale per output channel."""
    return QuantizedLinearWeights.from_fp8(*quantize_fp8_per_channel(w))


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (float8_e4m3fn [N, K], fp32 scale [N]) with scale = amax / 448 per row."""
    wf = w.float()
    amax = wf.abs().amax(dim=1).clamp(min=1e-12)  # an all-zero row gets a tiny, harmless scale
    scale = amax / FP8_MAX
    w8 = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, scale


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w8.float() * scale.float()[:, None]).to(dtype)


W8A8_ABOVE_ROWS = 64  # more rows than this: activations quantized per token (the decode GEMVs' limit below)


def takes_w8a8(M: int, w: QuantizedLinearWeights) -> bool:
    """Whether M rows of x meet fp8 weights w as w8a8 on a GPU with fp8 tensor cores (cuBLAS fp8 needs
    K and N multiples of 16)."""
    return M > W8A8_ABOVE_ROWS and w.in_features % 16 == 0 and w.out_features % 16 == 0


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 scale [M, 1]) with scale = row amax / 448 (the GPU's
    quantize_rows_fp8: values times the rounded reciprocal of the scale, as its kernel does)."""
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * (1.0 / FP8_MAX)
    return (xf * (1.0 / sx)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), sx


def w8a8_reference(x: torch.Tensor, w: QuantizedLinearWeights) -> torch.Tensor:
    """x [M, K] @ W^T with x quantized per token: fp32 products, rounded to bf16 as cuBLAS's fp8 GEMM
    writes it, returned in x.dtype."""
    x8, sx = quantize_rows_e4m3(x)
    y = (x8.float() * sx) @ dequantize_fp8(w.weight, w.scale).t()
    return y.to(torch.bfloat16).to(x.dtype)


def fp8_prefill_copy(w: QuantizedLinearWeights) -> QuantizedLinearWeights:
    """The fp8 twin of int4 weights for inputs past 16 rows: the dequantized int4 weights (original
    channel order) rounded to e4m3 with one scale per output channel. A second rounding on top of
    int4's (3 mantissa bits per weight), measured by salaserve.quant.quality."""
    if w.format != W4A16.name:
        raise ValueError(f"fp8_prefill_copy is for w4a16 weights, got {w.format!r}")
    w8, scale = quantize_fp8_per_channel(w.dequantize(torch.float32))
    copy = QuantizedLinearWeights.from_fp8(w8, scale)
    copy.w8a8 = True  # on the GPU prefill sizes meet it as w8a8 (takes_w8a8); fewer rows weight-only
    return copy


def attach_fp8_prefill_copies(linears) -> int:
    """Give every int4 linear of `linears` its fp8 copy (w.prefill) unless it has one; returns the
    copies' bytes."""
    added = 0
    for w in linears:
        if isinstance(w, QuantizedLinearWeights) and w.format == W4A16.name and w.prefill is None:
            w.prefill = fp8_prefill_copy(w)
            added += w.prefill.weight.nbytes + w.prefill.scale.nbytes
    return added


class Fp8Format(Format):
    """e4m3 weights, fp32 scale per output channel (module docstring)."""

    name = "fp8"
    quant_method = "fp8"

    def dequantize(self, w, dtype):
        return dequantize_fp8(w.weight, w.scale, dtype)

    def reference_linear(self, x, w):
        """Weights marked w8a8: w8a8 at prefill sizes; otherwise weight-only (module docstring)."""
        return w8a8_reference(x, w) if w.w8a8 and takes_w8a8(x.shape[0], w) else super().reference_linear(x, w)

    def concat(self, parts):
        return QuantizedLinearWeights.from_fp8(torch.cat([p.weight for p in parts], 0),
                                               torch.cat([p.scale for p in parts], 0))

    def quantize(self, weight, scheme):
        return quantize_fp8(weight)

    def parse_config(self, qc: dict, lm_head: bool) -> QuantScheme:
        if qc.get("weight_block_size") is not None:
            raise QuantConfigError("block-wise fp8 (quantization_config.weight_block_size) is not supported; "
                                   "salaserve's fp8 has one scale per output channel (`<linear>.weight_scale` [N])")
        if qc.get("weight_granularity") != "per_channel":  # other tools' fp8 (weight_scale_inv, per tensor)
            raise QuantConfigError("this fp8 checkpoint is not salaserve's per-channel fp8 (quantization_config."
                                   "weight_granularity must be 'per_channel', with `<linear>.weight_scale` [N]); "
                                   "re-quantize the bf16 model with `salaserve prepare-model --quant fp8`")
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise QuantConfigError(f"quantization_config.fmt={fmt!r}: only e4m3 fp8 weights are supported")
        return QuantScheme(self.name, lm_head=lm_head)

    def stores(self, base, dtypes) -> bool:
        return dtypes.get(f"{base}.weight") == "F8_E4M3" or f"{base}.weight_scale" in dtypes

    def checkpoint_shapes(self, base, n, k, scheme):
        return {f"{base}.weight": (n, k), f"{base}.weight_scale": (n,)}

    def found_shape(self, name, shape):
        if name.endswith(".weight_scale") and len(shape) == 2 and shape[1] == 1:
            return (shape[0],)  # a per-channel scale stored as a column [N, 1]
        return shape

    def check_dtype(self, part, dtype):
        if part == "weight":
            return None if dtype == "F8_E4M3" else "F8_E4M3"
        return super().check_dtype(part, dtype)

    def from_checkpoint(self, tensors, base, scheme):
        return QuantizedLinearWeights.from_fp8(tensors[f"{base}.weight"],
                                               tensors[f"{base}.weight_scale"].float().reshape(-1))

    def checkpoint_tensors(self, w, base, scheme):
        return {f"{base}.weight": w.weight, f"{base}.weight_scale": w.scale}


FP8 = Fp8Format()
