"""Quantized linears at load time: the tensors a quantized checkpoint must hold, their checks, the
`QuantizedLinearWeights` built from them, and quantize-on-load for unquantized checkpoints.

Per linear `<base>` (HF name `<base>.weight`, W [N, K]) a checkpoint holds either the tensors of the
scheme's format (Format.checkpoint_shapes: gptq's qweight / qzeros / scales / g_idx, fp8's weight
and weight_scale; formats/) or a plain float `<base>.weight` (a quantized checkpoint may leave
some linears native, e.g. GPTQModel's o_gate / z_proj); which one is read from the names and dtypes
(Format.stores). Embeddings and norms are never quantized; lm_head only when the config says
`lm_head: true`. Every problem (missing, unexpected, mis-shaped tensors, then wrong dtypes or
values) is reported in one error.

The engine gets, under the usual `<base>.weight` key, a QuantizedLinearWeights as its format builds
it (Format.from_checkpoint; int4: qzeros as true zeros, act-order weights sorted by group).
"""

from __future__ import annotations

import dataclasses

import torch
from safetensors import safe_open

from salaserve.config import ModelConfig
from salaserve.core.weights import WeightLoadError, expected_shapes, validate_names_and_shapes
from salaserve.quant import formats
from salaserve.quant.formats import CheckpointError, QuantizedLinearWeights
from salaserve.quant.formats.base import FLOAT_DTYPES
from salaserve.quant.scheme import QuantScheme


def quantizable_linears(cfg: ModelConfig, lm_head: bool) -> list[str]:
    """HF `.weight` names of the linears a scheme may quantize (every 2-D weight but embeddings)."""
    return [n for n, s in expected_shapes(cfg).items()
            if len(s) == 2 and n != "model.embed_tokens.weight" and (lm_head or n != "lm_head.weight")]


def _base(name: str) -> str:
    return name[: -len(".weight")]


def expected_quantized(cfg: ModelConfig, scheme: QuantScheme, dtypes: dict[str, str]
                       ) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(name -> shape, the bases of the linears stored in the scheme's format) the checkpoint must hold."""
    fmt = formats.get(scheme.format)
    want: dict[str, tuple[int, ...]] = {}
    stored: set[str] = set()
    quantizable = set(quantizable_linears(cfg, scheme.lm_head))
    for name, shape in expected_shapes(cfg).items():
        base = _base(name) if name.endswith(".weight") else name
        if name in quantizable and fmt.stores(base, dtypes):
            try:
                want.update(fmt.checkpoint_shapes(base, *shape, scheme))
            except CheckpointError as e:
                raise WeightLoadError(str(e)) from None
            stored.add(base)
        else:
            want[name] = shape
    return want, stored


def _check_dtypes(dtypes: dict[str, str], want: dict, stored: set[str], fmt) -> None:
    bad = []
    for name in want:
        base, _, part = name.rpartition(".")
        if base in stored:
            expect = fmt.check_dtype(part, dtypes[name])
        else:  # a plain tensor (norms, embeddings, unquantized linears)
            expect = None if dtypes[name] in FLOAT_DTYPES else "a float type"
        if expect is not None:
            bad.append(f"{name}: {dtypes[name]}, expected {expect}")
    if bad:
        raise WeightLoadError(f"quantized checkpoint has tensors of the wrong dtype ({len(bad)}): "
                              + "; ".join(bad[:20]) + (" ..." if len(bad) > 20 else ""))


def load_quantized(files: list[str], found: dict[str, tuple[int, ...]], cfg: ModelConfig, scheme: QuantScheme,
                   dtype: torch.dtype, device, ignore_unexpected: tuple[str, ...] = ()) -> dict:
    """Read a quantized checkpoint: HF `.weight` names -> tensors (norms, embeddings, unquantized
    linears, in `dtype`) or QuantizedLinearWeights (quantized linears, as stored)."""
    fmt = formats.get(scheme.format)
    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                dtypes[name] = f.get_slice(name).get_dtype()
    want, stored = expected_quantized(cfg, scheme, dtypes)
    shapes = {name: fmt.found_shape(name, s) if name.rpartition(".")[0] in stored else s for name, s in found.items()}
    validate_names_and_shapes(shapes, cfg, ignore_unexpected=ignore_unexpected, want=want)
    _check_dtypes(dtypes, want, stored, fmt)

    raw: dict[str, torch.Tensor] = {}
    dev = str(torch.device(device))
    for path in files:
        with safe_open(path, framework="pt", device=dev) as f:
            for name in f.keys():
                if name in want:
                    raw[name] = f.get_tensor(name)
    bad = [problem for base in stored for problem in fmt.check_tensors(raw, base)]
    if bad:
        raise WeightLoadError(f"quantized checkpoint has tensors with bad values ({len(bad)}): " + "; ".join(bad[:20]))

    out: dict = {}
    for name in expected_shapes(cfg):
        base = _base(name) if name.endswith(".weight") else name
        out[name] = fmt.from_checkpoint(raw, base, scheme) if base in stored else raw[name].to(dtype)
    return out


def quantize_on_load(w: dict, cfg: ModelConfig, scheme: QuantScheme) -> dict:
    """Quantize an unquantized state dict in place, one linear at a time with the scheme's format
    (Format.quantize: RTN int4 for w4a16, per-channel for fp8), so that at most one extra bf16
    tensor is alive."""
    fmt = formats.get(scheme.format)
    for name in quantizable_linears(cfg, scheme.lm_head):
        t = w[name]
        w[name] = fmt.quantize(t, scheme)
        del t
    return w


def stored_as_on_load(scheme: QuantScheme) -> QuantScheme:
    """Dummy weights of a checkpoint that declares a quantization: quantize them on load instead."""
    return dataclasses.replace(scheme, stored=False)


def dequantize_state_dict(w: dict, dtype: torch.dtype) -> dict:
    """Every QuantizedLinearWeights -> its dense weight in `dtype` (for the reference model)."""
    return {k: (v.dequantize(dtype) if isinstance(v, QuantizedLinearWeights) else v) for k, v in w.items()}
