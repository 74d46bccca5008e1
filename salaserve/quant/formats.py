"""Weight formats of a quantized Linear: GPTQ int4 packing, FP8 per-channel, and the container.

GPTQ int4 layout (as GPTQ / AutoGPTQ / GPTQModel checkpoints store it) for a Linear whose
weight is W [out=N, in=K]:

    qweight  int32 [K/8, N]          8 codes along K per int32; k = 8*row + j sits in bits 4j..4j+3
    qzeros   int32 [G, ceil(N/8)]    8 zero points along N per int32, same nibble order
    scales   fp16/bf16 [G, N]        G = ceil(K / group_size) (group_size -1 -> one group)
    g_idx    int32 [K]               group of each input channel (act-order permutes it)

    W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]

Zero-point convention. AutoGPTQ wrote `zero - 1` into qzeros (the "zero point minus one" quirk,
now called checkpoint_format "gptq" = v1); GPTQModel works on true zeros ("gptq_v2") and, when
saving with the default checkpoint_format "gptq", converts back by subtracting 0x11111111 from
each whole int32 (and adds it when loading). We do exactly that arithmetic, so a zero of 0 (which
v1 cannot hold per nibble) round-trips through files GPTQModel reads, and for zeros 1..15 it equals
AutoGPTQ's per-nibble `zero - 1`. Default everywhere: "gptq" (v1), what GPTQModel writes for
`checkpoint_format: "gptq"`. Symmetric 4-bit uses zero = 8 (stored 0x77777777 in v1).

QuantizedLinearWeights always holds v2 (true) zeros; conversion happens at the file boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

GPTQ_V1 = "gptq"
GPTQ_V2 = "gptq_v2"
_FORMATS_ZERO = (GPTQ_V1, GPTQ_V2)
_V1_OFFSET = 0x11111111  # one added to each of the 8 nibbles, with carries, as GPTQModel does
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)


def _to_int32(t: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits (two's complement wrap)."""
    t = t & 0xFFFFFFFF
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)


def _check_zero_format(fmt: str) -> None:
    if fmt not in _FORMATS_ZERO:
        raise ValueError(f"zero-point format must be one of {_FORMATS_ZERO}, got {fmt!r}")


# ---------------------------------------------------------------- int4 packing


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes q [K, N] in 0..15 -> qweight int32 [K/8, N] (lowest bits = lowest k)."""
    K, N = q.shape
    if K % 8:
        raise ValueError(f"in_features {K} must be a multiple of 8 to pack int4 along K")
    q64 = q.to(torch.int64).reshape(K // 8, 8, N)
    if q64.min() < 0 or q64.max() > 15:
        raise ValueError("int4 codes must lie in 0..15")
    packed = (q64 << _SHIFTS.to(q.device).view(1, 8, 1)).sum(dim=1)  # nibbles are disjoint
    return _to_int32(packed)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> codes uint8 [K, N]."""
    K8, N = qweight.shape
    q = (qweight.to(torch.int64).unsqueeze(1) >> _SHIFTS.to(qweight.device).view(1, 8, 1)) & 0xF
    return q.reshape(K8 * 8, N).to(torch.uint8)


def pack_zeros(zeros: torch.Tensor, fmt: str = GPTQ_V1) -> torch.Tensor:
    """True zero points [G, N] in 0..15 -> qzeros int32 [G, ceil(N/8)] in `fmt` ("gptq" = v1)."""
    _check_zero_format(fmt)
    G, N = zeros.shape
    z = zeros.to(torch.int64)
    if z.min() < 0 or z.max() > 15:
        raise ValueError("int4 zero points must lie in 0..15")
    pad = (-N) % 8
    if pad:  # N not a multiple of 8: the last int32 is padded with zero nibbles
        z = torch.cat([z, z.new_zeros(G, pad)], dim=1)
    packed = (z.reshape(G, -1, 8) << _SHIFTS.to(z.device).view(1, 1, 8)).sum(dim=2)
    if fmt == GPTQ_V1:
        packed = packed - _V1_OFFSET
    return _to_int32(packed)


def unpack_zeros(qzeros: torch.Tensor, n: Optional[int] = None, fmt: str = GPTQ_V1) -> torch.Tensor:
    """qzeros int32 [G, N/8] in `fmt` -> true zero points uint8 [G, n] (n defaults to 8*cols)."""
    _check_zero_format(fmt)
    z = qzeros.to(torch.int64)
    if fmt == GPTQ_V1:
        z = z + _V1_OFFSET
    z = z & 0xFFFFFFFF
    G, cols = qzeros.shape
    out = (z.unsqueeze(2) >> _SHIFTS.to(z.device).view(1, 1, 8)) & 0xF
    return out.reshape(G, cols * 8)[:, : (cols * 8 if n is None else n)].to(torch.uint8)


def convert_qzeros(qzeros: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Re-express packed zeros between "gptq" (v1) and "gptq_v2"."""
    _check_zero_format(src)
    _check_zero_format(dst)
    if src == dst:
        return qzeros
    delta = _V1_OFFSET if src == GPTQ_V1 else -_V1_OFFSET
    return _to_int32(qzeros.to(torch.int64) + delta)


def trivial_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """g_idx without act-order: input channel k belongs to group k // group_size."""
    gs = in_features if group_size <= 0 else group_size
    return torch.arange(in_features, dtype=torch.int32, device=device) // gs


def is_trivial_g_idx(g_idx: Optional[torch.Tensor], group_size: int) -> bool:
    if g_idx is None:
        return True
    return bool(torch.equal(g_idx.to(torch.int32), trivial_g_idx(g_idx.numel(), group_size, g_idx.device)))


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor] = None,
    group_size: int = 128,
    fmt: str = GPTQ_V1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """GPTQ tensors -> W [N, K]. g_idx=None means the trivial one from group_size."""
    q = unpack_int4(qweight)  # [K, N]
    K, N = q.shape
    if g_idx is None:
        g_idx = trivial_g_idx(K, group_size, qweight.device)
    g = g_idx.long()
    z = unpack_zeros(qzeros, N, fmt)
    w = (q.float() - z[g].float()) * scales[g].float()  # [K, N]
    return w.t().contiguous().to(dtype)


# ---------------------------------------------------------------- FP8 per output channel


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (float8_e4m3fn [N, K], fp32 scale [N]) with scale = amax / 448 per row."""
    wf = w.float()
    amax = wf.abs().amax(dim=1).clamp(min=1e-12)  # an all-zero row gets a tiny, harmless scale
    scale = amax / FP8_MAX
    w8 = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8, scale


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (w8.float() * scale.float()[:, None]).to(dtype)


def fp8_prefill_copy(w: "QuantizedLinearWeights") -> "QuantizedLinearWeights":
    """The fp8 twin of int4 weights for prefill-sized inputs: the dequantized int4 weights (original
    channel order) rounded to e4m3 with one scale per output channel. A second rounding on top of
    int4's (3 mantissa bits per weight), measured by salaserve.quant.quality."""
    if w.format != "w4a16":
        raise ValueError(f"fp8_prefill_copy is for w4a16 weights, got {w.format!r}")
    w8, scale = quantize_fp8_per_channel(w.dequantize(torch.float32))
    return QuantizedLinearWeights.from_fp8(w8, scale)


# ---------------------------------------------------------------- the container


@dataclass
class QuantizedLinearWeights:
    """What the engine's linear layer holds. y = x @ W^T with W [out_features, in_features].

    format "bf16":  weight [N, K] (any float dtype; bf16 in the engine)
    format "fp8":   weight float8_e4m3fn [N, K], scale fp32 [N]
    format "w4a16": qweight, qzeros (v2: true zeros), scales, g_idx as in the module docstring.
                    perm (optional, see reorder_act_order): qweight row k' holds input channel
                    perm[k'], so kernels read x[:, perm]; g_idx is then given in that order.
    """

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
    # w4a16 on the GPU: an fp8 copy (format "fp8", from the dequantized int4 weights) that prefill-sized
    # inputs meet through w8a8 on fp8 tensor cores (fp8_prefill_copy; EngineArgs.w4a16_prefill); None
    # elsewhere
    prefill: Optional["QuantizedLinearWeights"] = None

    def __post_init__(self):
        if self.format not in ("bf16", "fp8", "w4a16"):
            raise ValueError(f"unknown weight format {self.format!r}")

    # -- constructors
    @classmethod
    def from_dense(cls, w: torch.Tensor) -> "QuantizedLinearWeights":
        return cls("bf16", w.shape[1], w.shape[0], weight=w)

    @classmethod
    def from_fp8(cls, w8: torch.Tensor, scale: torch.Tensor) -> "QuantizedLinearWeights":
        return cls("fp8", w8.shape[1], w8.shape[0], weight=w8, scale=scale.float())

    @classmethod
    def from_gptq(
        cls,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        g_idx: Optional[torch.Tensor] = None,
        group_size: int = 128,
        fmt: str = GPTQ_V1,
    ) -> "QuantizedLinearWeights":
        """From checkpoint tensors; qzeros in `fmt` (default "gptq" = v1) are stored as v2."""
        K, N = qweight.shape[0] * 8, qweight.shape[1]
        gs = K if group_size <= 0 else group_size
        if g_idx is None:
            g_idx = trivial_g_idx(K, gs, qweight.device)
        return cls(
            "w4a16", K, N,
            qweight=qweight.contiguous(),
            qzeros=convert_qzeros(qzeros, fmt, GPTQ_V2).contiguous(),
            scales=scales.contiguous(),
            g_idx=g_idx.to(torch.int32).contiguous(),
            group_size=gs,
            g_idx_trivial=is_trivial_g_idx(g_idx, gs),
        )

    # -- views
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in the original input-channel order."""
        if self.format == "bf16":
            return self.weight.to(dtype)
        if self.format == "fp8":
            return dequantize_fp8(self.weight, self.scale, dtype)
        w = dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.group_size, GPTQ_V2, dtype)
        if self.perm is not None:
            w = w[:, torch.argsort(self.perm.long())]
        return w

    def to_checkpoint(self, fmt: str = GPTQ_V1) -> dict[str, torch.Tensor]:
        """w4a16 tensors as a GPTQ checkpoint stores them (qzeros in `fmt`)."""
        if self.format != "w4a16":
            raise ValueError("to_checkpoint is for w4a16 weights")
        if self.perm is not None:
            raise ValueError("a reordered (perm) layout has no checkpoint form; save before reorder_act_order")
        return {
            "qweight": self.qweight,
            "qzeros": convert_qzeros(self.qzeros, GPTQ_V2, fmt),
            "scales": self.scales,
            "g_idx": self.g_idx,
        }

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
        """Concatenate along the output dim (fused qkv / gate_up). Parts share K and format;
        w4a16 parts must also share group_size, g_idx and perm (one input, one channel order)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        first = parts[0]
        fmt, K = first.format, first.in_features
        for p in parts:
            if p.format != fmt or p.in_features != K:
                raise ValueError("concatenated weights must share format and in_features")
        N = sum(p.out_features for p in parts)
        if fmt == "bf16":
            return QuantizedLinearWeights.from_dense(torch.cat([p.weight for p in parts], 0))
        if fmt == "fp8":
            return QuantizedLinearWeights.from_fp8(
                torch.cat([p.weight for p in parts], 0), torch.cat([p.scale for p in parts], 0)
            )
        for p in parts[1:]:
            if p.group_size != first.group_size:
                raise ValueError("w4a16 parts have different group sizes")
            if not torch.equal(p.g_idx, first.g_idx):
                raise ValueError("w4a16 parts have different g_idx (act-order permutations differ); cannot fuse")
            if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
                raise ValueError("w4a16 parts have different channel permutations; cannot fuse")
        if all(p.out_features % 8 == 0 for p in parts):
            qzeros = torch.cat([p.qzeros for p in parts], 1)  # whole int32 columns line up
        else:
            zs = [unpack_zeros(p.qzeros, p.out_features, GPTQ_V2) for p in parts]
            qzeros = pack_zeros(torch.cat(zs, 1), GPTQ_V2)
        return QuantizedLinearWeights(
            "w4a16", K, N,
            qweight=torch.cat([p.qweight for p in parts], 1),
            qzeros=qzeros,
            scales=torch.cat([p.scales for p in parts], 1),
            g_idx=first.g_idx,
            group_size=first.group_size,
            perm=first.perm,
            g_idx_trivial=first.g_idx_trivial,
        )


def reorder_act_order(w: QuantizedLinearWeights) -> QuantizedLinearWeights:
    """Sort input channels by group (load-time, once) so that an act-order checkpoint runs on the
    kernels' contiguous-group fast path: qweight rows and g_idx are permuted, x is gathered through
    perm inside the kernel. For GPTQ act-order the sorted g_idx is exactly k // group_size."""
    if w.format != "w4a16" or w.perm is not None or w.g_idx_trivial:
        return w
    perm = torch.argsort(w.g_idx.long(), stable=True)
    q = unpack_int4(w.qweight)[perm]
    g_idx = w.g_idx[perm].contiguous()
    return dataclasses.replace(
        w,
        qweight=pack_int4(q),
        g_idx=g_idx,
        perm=perm.to(torch.int32),
        g_idx_trivial=is_trivial_g_idx(g_idx, w.group_size),
        wgmma=None,  # the kernel's copy of the old channel order
    )


def gptq_quantize_config(
    group_size: int = 128, sym: bool = True, desc_act: bool = False, static_groups: bool = False, fmt: str = GPTQ_V1
) -> dict:
    """The quantize_config.json that GPTQModel / transformers / vLLM read next to the weights."""
    _check_zero_format(fmt)
    return {
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "static_groups": static_groups,
        "true_sequential": True,
        "damp_percent": 0.01,
        "quant_method": "gptq",
        "checkpoint_format": fmt,
    }
