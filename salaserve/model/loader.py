"""Loads HF-format MiniCPM-SALA weights: sharded safetensors (memory-mapped) or dummy weights.

`load_state_dict` returns the checkpoint's own tensor names, validated against the spec's list;
the serving model fuses them afterwards (`fuse_state_dict`). Quantized checkpoints (GPTQ int4,
fp8) give QuantizedLinearWeights under the linears' `.weight` names (salaserve/quant/load.py).
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from salaserve.config import ModelConfig
from salaserve.core.weights import (WeightLoadError, checkpoint_files, expected_shapes, random_state_dict,
                                    validate_names_and_shapes)

def load_state_dict(model_dir, cfg: ModelConfig, dtype=torch.bfloat16, device="cpu",
                    load_format: str = "auto", seed: int = 0, quantization: str | None = None,
                    quantize_lm_head: bool = False) -> dict:
    """All tensors of the checkpoint in `dtype` on `device`, keyed by their HF names. Quantized
    linears come as QuantizedLinearWeights: as the checkpoint stores them, or quantized on load
    when `quantization` (a quant/formats name: fp8, w4a16) is asked of an unquantized checkpoint (lm_head too with
    quantize_lm_head)."""
    from salaserve.quant.load import load_quantized, quantize_on_load, stored_as_on_load
    from salaserve.quant.scheme import QuantConfigError, resolve_scheme

    try:
        scheme = resolve_scheme(model_dir, cfg.extra, quantization, lm_head=quantize_lm_head)
    except QuantConfigError as e:
        raise WeightLoadError(str(e)) from None
    if load_format == "dummy":
        w = random_state_dict(cfg, seed=seed, dtype=dtype, device=device)
        return w if scheme is None else quantize_on_load(w, cfg, stored_as_on_load(scheme))
    if load_format not in ("auto", "safetensors"):
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    model_dir = os.fspath(model_dir)
    files = checkpoint_files(model_dir)
    found: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                found[name] = tuple(f.get_slice(name).get_shape())
    # Rotary caches are non-persistent in HF; some re-saves still carry them.
    ignore = ("rotary_emb.inv_freq",)
    if scheme is not None and scheme.stored:
        return load_quantized(files, found, cfg, scheme, dtype, device, ignore_unexpected=ignore)
    validate_names_and_shapes(found, cfg, ignore_unexpected=ignore)
    want = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    dev = str(torch.device(device))
    for path in files:
        with safe_open(path, framework="pt", device=dev) as f:
            for name in f.keys():
                if name in want:
                    out[name] = f.get_tensor(name).to(dtype)
    return out if scheme is None else quantize_on_load(out, cfg, scheme)
