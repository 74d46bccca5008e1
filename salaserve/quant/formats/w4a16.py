"""The w4a16 format: int4 weights in the GPTQ layout (bf16 activations), as GPTQ / AutoGPTQ /
GPTQModel checkpoints store them (quant_method "gptq"; --quantization w4a16, or gptq for a checkpoint
that must store it).

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
Act-order checkpoints are reordered at load (reorder_act_order) for the kernels' contiguous groups.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from salaserve.quant.formats.base import (DEFAULT_GROUP_SIZE, FLOAT_DTYPES, GPTQ_V1, CheckpointError, Format,
                                          QuantConfigError, QuantScheme, config_bool)
from salaserve.quant.formats.container import QuantizedLinearWeights

GPTQ_V2 = "gptq_v2"
_FORMATS_ZERO = (GPTQ_V1, GPTQ_V2)
_V1_OFFSET = 0x11111111  # one added to each of the 8 nibbles, with carries, as GPTQModel does
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a linear's checkpoint tensors, <base>.<part>
# keys of a GPTQModel `dynamic` override that change how a module's tensors must be read
_FORMAT_KEYS = ("bits", "group_size", "sym", "desc_act", "pack_dtype", "checkpoint_format", "format")


def to_int32(t: torch.Tensor) -> torch.Tensor:
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
    return to_int32(packed)


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
    return to_int32(packed)


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
    return to_int32(qzeros.to(torch.int64) + delta)


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


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor] = None,
              group_size: int = 128, fmt: str = GPTQ_V1) -> QuantizedLinearWeights:
    """w4a16 weights from GPTQ checkpoint tensors; qzeros in `fmt` (default "gptq" = v1) are stored as v2."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    gs = K if group_size <= 0 else group_size
    if g_idx is None:
        g_idx = trivial_g_idx(K, gs, qweight.device)
    return QuantizedLinearWeights(
        W4a16Format.name, K, N,
        qweight=qweight.contiguous(),
        qzeros=convert_qzeros(qzeros, fmt, GPTQ_V2).contiguous(),
        scales=scales.contiguous(),
        g_idx=g_idx.to(torch.int32).contiguous(),
        group_size=gs,
        g_idx_trivial=is_trivial_g_idx(g_idx, gs),
    )


def gptq_tensors(w: QuantizedLinearWeights, fmt: str = GPTQ_V1) -> dict[str, torch.Tensor]:
    """w's tensors as a GPTQ checkpoint stores them (qzeros in `fmt`), by part name."""
    if w.perm is not None:
        raise ValueError("a reordered (perm) layout has no checkpoint form; save before reorder_act_order")
    return {"qweight": w.qweight, "qzeros": convert_qzeros(w.qzeros, GPTQ_V2, fmt), "scales": w.scales,
            "g_idx": w.g_idx}


def gptq_shapes(base: str, n: int, k: int, group_size: int) -> dict[str, tuple[int, ...]]:
    """The GPTQ tensors of linear `base` with W [n, k] and their shapes."""
    groups = 1 if group_size <= 0 else -(-k // group_size)
    return {f"{base}.qweight": (k // 8, n), f"{base}.qzeros": (groups, -(-n // 8)),
            f"{base}.scales": (groups, n), f"{base}.g_idx": (k,)}


def reorder_act_order(w: QuantizedLinearWeights) -> QuantizedLinearWeights:
    """Sort input channels by group (load-time, once) so that an act-order checkpoint runs on the
    kernels' contiguous-group fast path: qweight rows and g_idx are permuted, x is gathered through
    perm inside the kernel. For GPTQ act-order the sorted g_idx is exactly k // group_size."""
    if w.format != W4A16.name or w.perm is not None or w.g_idx_trivial:
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


# ---------------------------------------------------------------- the format


def _check_dynamic(dynamic, base: dict) -> None:
    """GPTQModel's per-module overrides: "-:regex" excludes modules (they are then plain bf16
    tensors, which the loader sees per name); "+:regex" / "regex" overrides must not change the
    on-disk format, since every quantized linear is read with the global settings."""
    if not dynamic:
        return
    if not isinstance(dynamic, dict):
        raise QuantConfigError(f"quantization_config.dynamic must be an object, got {type(dynamic).__name__}")
    bad = []
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            continue
        for key in _FORMAT_KEYS:
            if isinstance(overrides, dict) and key in overrides and overrides[key] != base.get(key, overrides[key]):
                bad.append(f"{pattern!r}: {key}={overrides[key]!r}")
    if bad:
        raise QuantConfigError("quantization_config.dynamic overrides the format per module, which salaserve "
                               "does not support: " + "; ".join(bad))


# ---- round-to-nearest on the int4 grid (shared with GPTQ: quant/gptq.py) ----

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
    return from_gptq(
        pack_int4(q.t()), pack_zeros(zeros, GPTQ_V2), scales, trivial_g_idx(K, gs, w.device), gs, GPTQ_V2
    )



class W4a16Format(Format):
    """int4 weights in the GPTQ layout (module docstring); on load: RTN int4 (quantize_w4a16_rtn)."""

    name = "w4a16"
    quant_method = "gptq"
    stored_aliases = ("gptq",)

    # the container's GPTQ constructors and checkpoint view (QuantizedLinearWeights.from_gptq /
    # .to_checkpoint reach them through the registry)
    from_gptq = staticmethod(from_gptq)
    gptq_tensors = staticmethod(gptq_tensors)

    def dequantize(self, w, dtype):
        out = dequantize_gptq(w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, GPTQ_V2, dtype)
        if w.perm is not None:
            out = out[:, torch.argsort(w.perm.long())]
        return out

    def fusable(self, a, b) -> bool:
        """One input, one channel order: the same group size, g_idx and act-order permutation."""
        same_perm = (a.perm is None and b.perm is None) or (
            a.perm is not None and b.perm is not None and torch.equal(a.perm, b.perm))
        return a.group_size == b.group_size and same_perm and torch.equal(a.g_idx, b.g_idx)

    def concat(self, parts):
        first = parts[0]
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
            self.name, first.in_features, sum(p.out_features for p in parts),
            qweight=torch.cat([p.qweight for p in parts], 1),
            qzeros=qzeros,
            scales=torch.cat([p.scales for p in parts], 1),
            g_idx=first.g_idx,
            group_size=first.group_size,
            perm=first.perm,
            g_idx_trivial=first.g_idx_trivial,
        )

    def quantize(self, weight, scheme):
        return quantize_w4a16_rtn(weight, scheme.group_size, scheme.sym)

    def slice_out(self, w, lo, hi):
        """Output channels [lo, hi): qweight / scales columns; qzeros (8 channels an int32)
        repacked unless the cut falls on whole int32 columns."""
        if lo % 8 == 0 and (hi % 8 == 0 or hi == w.out_features):
            qzeros = w.qzeros[:, lo // 8: -(-hi // 8)]
        else:
            qzeros = pack_zeros(unpack_zeros(w.qzeros, w.out_features, GPTQ_V2)[:, lo:hi], GPTQ_V2)
        return dataclasses.replace(w, out_features=hi - lo, qweight=w.qweight[:, lo:hi].contiguous(),
                                   qzeros=qzeros.contiguous(), scales=w.scales[:, lo:hi].contiguous(),
                                   wgmma=None, prefill=None)

    def slice_in(self, w, lo, hi):
        """Input channels [lo, hi): whole groups only, so each rank keeps the scales and zeros of
        its own groups and the TP=1 weights exactly (ValueError for a cut inside a group or an
        act-order layout, whose groups are spread over all of K)."""
        gs, K = w.group_size, w.in_features
        if w.perm is not None or not w.g_idx_trivial:
            raise ValueError("act-order (desc_act) int4 weights spread every group over the whole input dim; "
                             "they cannot be split by input channels")
        if lo % gs or (hi % gs and hi != K):
            raise ValueError(f"the input channels [{lo}, {hi}) of K = {K} cut through int4 groups of {gs}; each "
                             f"rank's share of K must be a multiple of the group size (K / tp_size % {gs} == 0)")
        if lo % 8 or hi % 8:
            raise ValueError(f"the input channels [{lo}, {hi}) do not fall on the int4 packing (8 per int32)")
        g0, g1 = lo // gs, -(-hi // gs)
        return dataclasses.replace(w, in_features=hi - lo, qweight=w.qweight[lo // 8: hi // 8].contiguous(),
                                   qzeros=w.qzeros[g0:g1].contiguous(), scales=w.scales[g0:g1].contiguous(),
                                   g_idx=trivial_g_idx(hi - lo, gs, w.g_idx.device), wgmma=None, prefill=None)

    def parse_config(self, qc: dict, lm_head: bool) -> QuantScheme:
        bits = qc.get("bits", qc.get("w_bit"))
        if bits not in (4, "4"):  # newer GPTQModel may serialize bits as a string
            raise QuantConfigError(f"quantization_config.bits={bits!r}: only 4-bit GPTQ checkpoints are supported")
        if qc.get("is_marlin_format"):
            raise QuantConfigError("quantization_config.is_marlin_format=true: Marlin-repacked weights are not "
                                   "supported; use the plain GPTQ checkpoint")
        fmt = str(qc.get("checkpoint_format", qc.get("format", GPTQ_V1))).lower()
        if fmt not in (GPTQ_V1, GPTQ_V2):
            raise QuantConfigError(f"quantization_config.checkpoint_format={fmt!r} is not supported "
                                   f"(supported: {GPTQ_V1!r}, {GPTQ_V2!r})")
        pack = str(qc.get("pack_dtype", "int32")).replace("torch.", "")
        if pack != "int32":
            raise QuantConfigError(f"quantization_config.pack_dtype={pack!r}: only int32 packing is supported")
        gs = qc.get("group_size", DEFAULT_GROUP_SIZE)
        if not isinstance(gs, int) or isinstance(gs, bool) or (gs <= 0 and gs != -1):
            raise QuantConfigError(f"quantization_config.group_size must be a positive integer or -1, got {gs!r}")
        scheme = QuantScheme(self.name, group_size=gs, sym=config_bool(qc, "sym", True),
                             desc_act=config_bool(qc, "desc_act", False), checkpoint_format=fmt, lm_head=lm_head)
        _check_dynamic(qc.get("dynamic"), {"bits": 4, "group_size": gs, "sym": scheme.sym,
                                           "desc_act": scheme.desc_act, "pack_dtype": "int32",
                                           "checkpoint_format": fmt, "format": fmt})
        return scheme

    def stores(self, base, dtypes) -> bool:
        return any(f"{base}.{p}" in dtypes for p in GPTQ_PARTS)

    def checkpoint_shapes(self, base, n, k, scheme):
        if k % 8:
            raise CheckpointError(f"{base}.weight: in_features {k} is not a multiple of 8; it cannot be int4-packed")
        return gptq_shapes(base, n, k, scheme.group_size)

    def check_dtype(self, part, dtype):
        if part == "scales":
            return None if dtype in FLOAT_DTYPES else "a float type"
        return None if dtype == "I32" else "I32 (pack_dtype int32)"

    def check_tensors(self, tensors, base):
        g = tensors[f"{base}.g_idx"]
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= tensors[f"{base}.scales"].shape[0]):
            return [f"{base}.g_idx names groups outside [0, groups)"]
        return []

    def from_checkpoint(self, tensors, base, scheme):
        w = from_gptq(tensors[f"{base}.qweight"], tensors[f"{base}.qzeros"], tensors[f"{base}.scales"],
                      tensors[f"{base}.g_idx"], scheme.group_size, scheme.checkpoint_format)
        return reorder_act_order(w)  # no-op unless act-order: the kernels then read groups contiguously

    def checkpoint_tensors(self, w, base, scheme):
        return {f"{base}.{k}": v for k, v in gptq_tensors(w, scheme.checkpoint_format).items()}


W4A16 = W4a16Format()
