"""Quantized linears at load time: the tensors a quantized checkpoint must hold, their checks, the
`QuantizedLinearWeights` built from them, and quantize-on-load for unquantized checkpoints.

Per linear `<base>` (HF name `<base>.weight`, W [N, K]) a checkpoint holds one of
  bf16   <base>.weight                                    (also in a quantized checkpoint: GPTQModel
                                                           leaves some linears, e.g. o_gate/z_proj, native)
  gptq   <base>.qweight int32 [K/8, N], .qzeros int32 [G, ceil(N/8)], .scales fp16 [G, N],
         .g_idx int32 [K]                                 G = ceil(K / group_size)
  fp8    <base>.weight float8_e4m3fn [N, K], <base>.weight_scale fp32 [N] (or [N, 1])
which one is read from the names (gptq) or the weight's dtype (fp8). Embeddings and norms are
never quantized; lm_head only when the config says `lm_head: true`. Every problem (missing,
unexpected, mis-shaped tensors, then wrong dtypes or g_idx values) is reported in one error.

The engine gets, under the usual `<base>.weight` key, a QuantizedLinearWeights (qzeros as true
zeros; act-order weights already sorted by group for the kernels' fast path, formats.reorder_act_order).
"""

from __future__ import annotations

import dataclasses

import torch
from safetensors import safe_open

from salaserve.config import ModelConfig
from salaserve.core.weights import WeightLoadError, expected_shapes, validate_names_and_shapes
from salaserve.quant.formats import QuantizedLinearWeights, reorder_act_order
from salaserve.quant.rtn import quantize_fp8, quantize_w4a16_rtn
from salaserve.quant.scheme import QuantScheme

GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_FLOAT_DTYPES = ("BF16", "F16", "F32")


def quantizable_linears(cfg: ModelConfig, lm_head: bool) -> list[str]:
    """HF `.weight` names of the linears a scheme may quantize (every 2-D weight but embeddings)."""
    return [n for n, s in expected_shapes(cfg).items()
            if len(s) == 2 and n != "model.embed_tokens.weight" and (lm_head or n != "lm_head.weight")]


def _base(name: str) -> str:
    return name[: -len(".weight")]


def gptq_shapes(base: str, n: int, k: int, group_size: int) -> dict[str, tuple[int, ...]]:
    groups = 1 if group_size <= 0 else -(-k // group_size)
    return {f"{base}.qweight": (k // 8, n), f"{base}.qzeros": (groups, -(-n // 8)),
            f"{base}.scales": (groups, n), f"{base}.g_idx": (k,)}


def _linear_kind(base: str, scheme: QuantScheme, dtypes: dict[str, str]) -> str:
    """'gptq', 'fp8' or 'bf16': what this checkpoint stores for one linear, read from its names."""
    if scheme.method == "gptq":
        return "gptq" if any(f"{base}.{p}" in dtypes for p in GPTQ_PARTS) else "bf16"
    if dtypes.get(f"{base}.weight") == "F8_E4M3" or f"{base}.weight_scale" in dtypes:
        return "fp8"
    return "bf16"


def expected_quantized(cfg: ModelConfig, scheme: QuantScheme, dtypes: dict[str, str]
                       ) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> shape, base -> kind) the checkpoint must hold, given which linears it quantizes."""
    want: dict[str, tuple[int, ...]] = {}
    kinds: dict[str, str] = {}
    quantizable = set(quantizable_linears(cfg, scheme.lm_head))
    for name, shape in expected_shapes(cfg).items():
        base = _base(name) if name.endswith(".weight") else name
        kind = _linear_kind(base, scheme, dtypes) if name in quantizable else "bf16"
        if kind == "gptq":
            n, k = shape
            if k % 8:
                raise WeightLoadError(f"{name}: in_features {k} is not a multiple of 8; it cannot be int4-packed")
            want.update(gptq_shapes(base, n, k, scheme.group_size))
            kinds[base] = kind
        elif kind == "fp8":
            want[name] = shape
            want[f"{base}.weight_scale"] = (shape[0],)
            kinds[base] = kind
        else:
            want[name] = shape
    return want, kinds


def _check_dtypes(dtypes: dict[str, str], want: dict, kinds: dict[str, str]) -> None:
    bad = []
    for name in want:
        base, _, part = name.rpartition(".")
        kind = kinds.get(base, "bf16")
        got = dtypes[name]
        if kind == "gptq":
            ok = got in _FLOAT_DTYPES if part == "scales" else got == "I32"
            expect = "a float type" if part == "scales" else "I32 (pack_dtype int32)"
        elif kind == "fp8" and part == "weight":
            ok, expect = got == "F8_E4M3", "F8_E4M3"
        else:
            ok, expect = got in _FLOAT_DTYPES, "a float type"
        if not ok:
            bad.append(f"{name}: {got}, expected {expect}")
    if bad:
        raise WeightLoadError(f"quantized checkpoint has tensors of the wrong dtype ({len(bad)}): "
                              + "; ".join(bad[:20]) + (" ..." if len(bad) > 20 else ""))


def _gptq_linear(t: dict[str, torch.Tensor], base: str, scheme: QuantScheme) -> QuantizedLinearWeights:
    w = QuantizedLinearWeights.from_gptq(t[f"{base}.qweight"], t[f"{base}.qzeros"], t[f"{base}.scales"],
                                         t[f"{base}.g_idx"], scheme.group_size, scheme.checkpoint_format)
    return reorder_act_order(w)  # no-op unless act-order: the kernels then read groups contiguously


def load_quantized(files: list[str], found: dict[str, tuple[int, ...]], cfg: ModelConfig, scheme: QuantScheme,
                   dtype: torch.dtype, device, ignore_unexpected: tuple[str, ...] = ()) -> dict:
    """Read a quantized checkpoint: HF `.weight` names -> tensors (norms, embeddings, unquantized
    linears, in `dtype`) or QuantizedLinearWeights (quantized linears, as stored)."""
    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                dtypes[name] = f.get_slice(name).get_dtype()
    want, kinds = expected_quantized(cfg, scheme, dtypes)
    shapes = dict(found)
    for base, kind in kinds.items():  # a per-channel scale may also be stored as a column [N, 1]
        s = shapes.get(f"{base}.weight_scale")
        if kind == "fp8" and s is not None and len(s) == 2 and s[1] == 1:
            shapes[f"{base}.weight_scale"] = (s[0],)
    validate_names_and_shapes(shapes, cfg, ignore_unexpected=ignore_unexpected, want=want)
    _check_dtypes(dtypes, want, kinds)

    raw: dict[str, torch.Tensor] = {}
    dev = str(torch.device(device))
    for path in files:
        with safe_open(path, framework="pt", device=dev) as f:
            for name in f.keys():
                if name in want:
                    raw[name] = f.get_tensor(name)
    bad_gidx = []
    for base, kind in kinds.items():
        if kind == "gptq":
            g = raw[f"{base}.g_idx"]
            if g.numel() and (int(g.min()) < 0 or int(g.max()) >= raw[f"{base}.scales"].shape[0]):
                bad_gidx.append(f"{base}.g_idx")
    if bad_gidx:
        raise WeightLoadError("g_idx names groups outside [0, groups) in: " + ", ".join(bad_gidx))

    out: dict = {}
    for name in expected_shapes(cfg):
        base = _base(name) if name.endswith(".weight") else name
        kind = kinds.get(base, "bf16")
        if kind == "gptq":
            out[name] = _gptq_linear(raw, base, scheme)
        elif kind == "fp8":
            out[name] = QuantizedLinearWeights.from_fp8(raw[name], raw[f"{base}.weight_scale"].float().reshape(-1))
        else:
            out[name] = raw[name].to(dtype)
    return out


def quantize_on_load(w: dict, cfg: ModelConfig, scheme: QuantScheme) -> dict:
    """Quantize an unquantized state dict in place, one linear at a time (RTN int4 for gptq,
    per-channel for fp8), so that at most one extra bf16 tensor is alive."""
    for name in quantizable_linears(cfg, scheme.lm_head):
        t = w[name]
        w[name] = quantize_fp8(t) if scheme.method == "fp8" else quantize_w4a16_rtn(t, scheme.group_size, scheme.sym)
        del t
    return w


def stored_as_on_load(scheme: QuantScheme) -> QuantScheme:
    """Dummy weights of a checkpoint that declares a quantization: quantize them on load instead."""
    return dataclasses.replace(scheme, stored=False)


def dequantize_state_dict(w: dict, dtype: torch.dtype) -> dict:
    """Every QuantizedLinearWeights -> its dense weight in `dtype` (for the reference model)."""
    return {k: (v.dequantize(dtype) if isinstance(v, QuantizedLinearWeights) else v) for k, v in w.items()}
