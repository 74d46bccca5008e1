"""Which quantization a checkpoint carries, what the user asked for, and the JSON that says so.

A checkpoint declares its quantization in `config.json["quantization_config"]` (what transformers,
vLLM and SGLang read) and, for GPTQ, also in `quantize_config.json` (what GPTQModel / AutoGPTQ
write next to the weights; config.json wins when both exist). Two methods are served:

  gptq  4-bit weights in the GPTQ layout (formats/w4a16.py), as GPTQModel writes them:
        {"bits": 4, "group_size": 128, "desc_act": false, "sym": true, "lm_head": false,
         "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32", "meta": {...}}
  fp8   salaserve's own: `<linear>.weight` float8_e4m3fn [N, K] + `<linear>.weight_scale` fp32 [N]
        {"quant_method": "fp8", "fmt": "e4m3", "weight_granularity": "per_channel",
         "activation_scheme": "dynamic", "lm_head": false}

Anything else (other bit widths, Marlin/BitBLAS repacks, block-wise fp8, per-module `dynamic`
overrides that change the format) is refused with one message that names the field.

Each format's own fields are read by its Format.parse_config (quant/formats/). `EngineArgs.quantization`
(a registered format's name, or a stored alias such as "gptq"; None) is resolved against the
checkpoint by `resolve_scheme`: None takes what the checkpoint carries; a format named for an
unquantized (or dummy) checkpoint means quantize on load (Format.quantize: RTN int4 for w4a16,
per-channel for fp8).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from salaserve.quant import formats
from salaserve.quant.formats import GPTQ_V1, QuantConfigError, QuantScheme, gptq_quantize_config
from salaserve.quant.formats.base import config_bool

__all__ = ["QuantConfigError", "QuantScheme", "parse_quant_config", "resolve_scheme", "checkpoint_quant_config",
           "gptq_config_json", "fp8_config_json", "QUANTIZE_CONFIG_FILE"]

QUANTIZE_CONFIG_FILE = "quantize_config.json"


# ---------------------------------------------------------------- reading


def parse_quant_config(qc: dict) -> QuantScheme:
    """A `quantization_config` / `quantize_config.json` object -> QuantScheme (stored=True): the
    format whose quant_method it names parses the rest (Format.parse_config)."""
    if not isinstance(qc, dict):
        raise QuantConfigError("quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "gptq")).lower()
    lm_head = config_bool(qc, "lm_head", False)
    if qc.get("rotation"):  # GPTQModel's Hadamard / random rotations change the math, not just the storage
        raise QuantConfigError(f"quantization_config.rotation={qc['rotation']!r} (rotated weights) is not supported")
    fmt = formats.for_quant_method(method)
    if fmt is None:
        known = ", ".join(repr(f.quant_method) for f in map(formats.get, formats.names()) if f.quant_method)
        raise QuantConfigError(f"quantization_config.quant_method={method!r} is not supported (supported: {known})")
    return fmt.parse_config(qc, lm_head)


def checkpoint_quant_config(model_dir, config_extra: dict) -> Optional[dict]:
    """The checkpoint's quantization config object, or None for an unquantized checkpoint."""
    qc = config_extra.get("quantization_config")
    if qc is not None:
        return qc
    path = os.path.join(os.fspath(model_dir), QUANTIZE_CONFIG_FILE) if model_dir else None
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise QuantConfigError(f"{path}: not valid JSON ({e})") from None
    return None


def resolve_scheme(model_dir, config_extra: dict, requested: Optional[str],
                   lm_head: bool = False) -> Optional[QuantScheme]:
    """What the engine loads: the checkpoint's scheme, or quantize-on-load of `requested` (a
    --quantization value; lm_head: quantize lm_head too, on load only)."""
    fmt = None
    if requested is not None:
        fmt = formats.for_quantization(requested)
        if fmt is None:
            raise QuantConfigError(f"quantization must be one of {', '.join(formats.quantization_choices())} "
                                   f"(or unset), got {requested!r}")
    qc = checkpoint_quant_config(model_dir, config_extra)
    found = parse_quant_config(qc) if qc is not None else None
    if found is not None:
        if fmt is not None and fmt.name != found.format:
            raise QuantConfigError(f"the checkpoint is {found.format}-quantized "
                                   f"(quant_method {formats.get(found.format).quant_method!r}) but "
                                   f"quantization={requested!r} was requested")
        if lm_head and not found.lm_head:
            raise QuantConfigError("this checkpoint is already quantized with lm_head in bf16; quantize_lm_head "
                                   "applies to quantize-on-load of a bf16 checkpoint only (prepare-model "
                                   "--quantize-lm-head writes one with lm_head quantized)")
        return found
    if fmt is None:
        if lm_head:
            raise QuantConfigError("quantize_lm_head needs a quantization to quantize on load (this checkpoint "
                                   "is unquantized)")
        return None
    if requested in fmt.stored_aliases:
        raise QuantConfigError(f"quantization={requested!r} needs a checkpoint that stores it (quant_method "
                               f"{fmt.quant_method!r}), but this one is unquantized: run `salaserve prepare-model`, "
                               f"or use quantization={fmt.name!r} to quantize on load")
    return QuantScheme(fmt.name, lm_head=lm_head, stored=False)  # on load: the format's defaults (w4a16: RTN, group 128, symmetric)


# ---------------------------------------------------------------- writing


def gptq_config_json(group_size: int, sym: bool, desc_act: bool, lm_head: bool, method: str,
                     fmt: str = GPTQ_V1, damp_percent: float = 0.01) -> dict:
    """quantize_config.json / quantization_config of a GPTQ checkpoint we write: GPTQModel's fields
    (so GPTQModel, transformers and vLLM read it), with how it was made under `meta`."""
    from salaserve._version import __version__

    out = gptq_quantize_config(group_size=group_size, sym=sym, desc_act=desc_act, fmt=fmt)
    out.update({"lm_head": lm_head, "pack_dtype": "int32", "damp_percent": damp_percent,
                "true_sequential": False,  # o_proj's Hessian comes from the unquantized q/k/v of its layer
                "meta": {"quantizer": [f"salaserve:{__version__}"], "method": method}})
    return out


def fp8_config_json(lm_head: bool) -> dict:
    from salaserve._version import __version__

    return {"quant_method": "fp8", "fmt": "e4m3", "weight_granularity": "per_channel",
            "activation_scheme": "dynamic", "lm_head": lm_head,
            "meta": {"quantizer": [f"salaserve:{__version__}"]}}
