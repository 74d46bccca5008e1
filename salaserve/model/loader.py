"""Loads HF-format MiniCPM-SALA weights: sharded safetensors (memory-mapped) or dummy weights.

`load_state_dict` returns the checkpoint's own tensor names, validated against the spec's list;
the serving model fuses them afterwards (`fuse_state_dict`). Quantized checkpoints (GPTQ int4,
fp8) give QuantizedLinearWeights under the linears' `.weight` names (salaserve/quant/load.py).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from salaserve.config import ModelConfig
from salaserve.model.weights import expected_shapes, random_state_dict

INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not match the config; the message lists every problem."""


def checkpoint_files(model_dir: str) -> list[str]:
    """Shard files of a checkpoint: from the index when present, else every *.safetensors."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(model_dir, fn))]
        if missing:
            raise WeightLoadError(f"{INDEX_FILE} names shard(s) that do not exist: {', '.join(missing)}")
        return [os.path.join(model_dir, fn) for fn in files]
    files = sorted(fn for fn in os.listdir(model_dir) if fn.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_dir} (use load_format='dummy' for random weights)")
    return [os.path.join(model_dir, fn) for fn in files]


def validate_names_and_shapes(found: dict[str, tuple[int, ...]], cfg: ModelConfig,
                              ignore_unexpected: tuple[str, ...] = (), want=None) -> None:
    """One error that lists all missing, unexpected and mis-shaped tensors (against `want`,
    default: the unquantized checkpoint's names)."""
    want = expected_shapes(cfg) if want is None else want
    missing = [n for n in want if n not in found]
    unexpected = [n for n in found if n not in want and not any(n.endswith(s) for s in ignore_unexpected)]
    misshaped = [f"{n}: checkpoint {list(found[n])}, config expects {list(want[n])}"
                 for n in want if n in found and tuple(found[n]) != want[n]]
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing ({len(missing)}): " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            parts.append(f"unexpected ({len(unexpected)}): " + ", ".join(unexpected[:20]) + (" ..." if len(unexpected) > 20 else ""))
        if misshaped:
            parts.append(f"wrong shape ({len(misshaped)}): " + "; ".join(misshaped[:20]))
        raise WeightLoadError("checkpoint does not match config.json:\n  " + "\n  ".join(parts))


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
