"""Which quantization a checkpoint carries, what the user asked for, and the JSON that says so.

A checkpoint declares its quantization in `config.json["quantization_config"]` (what transformers,
vLLM and SGLang read) and, for GPTQ, also in `quantize_config.json` (what GPTQModel / AutoGPTQ
write next to the weights; config.json wins when both exist). Two methods are served:

  gptq  4-bit weights in the GPTQ layout (formats.py), as GPTQModel writes them:
        {"bits": 4, "group_size": 128, "desc_act": false, "sym": true, "lm_head": false,
         "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32", "meta": {...}}
  fp8   salaserve's own: `<linear>.weight` float8_e4m3fn [N, K] + `<linear>.weight_scale` fp32 [N]
        {"quant_method": "fp8", "fmt": "e4m3", "weight_granularity": "per_channel",
         "activation_scheme": "dynamic", "lm_head": false}

Anything else (other bit widths, Marlin/BitBLAS repacks, block-wise fp8, per-module `dynamic`
overrides that change the format) is refused with one message that names the field.

`EngineArgs.quantization` ("fp8" | "w4a16" | "gptq" | None) is resolved against the checkpoint by
`resolve_scheme`: None takes what the checkpoint carries; a method given for an unquantized (or
dummy) checkpoint means quantize on load (RTN int4 for w4a16, per-channel for fp8).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from salaserve.quant.formats import GPTQ_V1, GPTQ_V2, gptq_quantize_config

QUANTIZE_CONFIG_FILE = "quantize_config.json"
ENGINE_CHOICES = ("fp8", "w4a16", "gptq")  # EngineArgs.quantization / --quantization
DEFAULT_GROUP_SIZE = 128
# keys of a GPTQModel `dynamic` override that change how a module's tensors must be read
_FORMAT_KEYS = ("bits", "group_size", "sym", "desc_act", "pack_dtype", "checkpoint_format", "format")


class QuantConfigError(ValueError):
    """A quantization config salaserve cannot serve; the message names the field."""


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "gptq" (int4, GPTQ layout) or "fp8"
    group_size: int = DEFAULT_GROUP_SIZE  # -1: one group per output channel (whole K)
    sym: bool = True
    desc_act: bool = False  # act-order: g_idx is a permutation of the groups
    checkpoint_format: str = GPTQ_V1  # zero-point convention of qzeros on disk
    lm_head: bool = False
    stored: bool = True  # False: the checkpoint is bf16 and the engine quantizes on load

    @property
    def engine_name(self) -> str:
        return "w4a16" if self.method == "gptq" else "fp8"


# ---------------------------------------------------------------- reading


def _as_bool(qc: dict, key: str, default: bool) -> bool:
    v = qc.get(key, default)
    if not isinstance(v, bool):
        raise QuantConfigError(f"quantization_config.{key} must be true or false, got {v!r}")
    return v


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


def parse_quant_config(qc: dict) -> QuantScheme:
    """A `quantization_config` / `quantize_config.json` object -> QuantScheme (stored=True)."""
    if not isinstance(qc, dict):
        raise QuantConfigError("quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "gptq")).lower()
    lm_head = _as_bool(qc, "lm_head", False)
    if qc.get("rotation"):  # GPTQModel's Hadamard / random rotations change the math, not just the storage
        raise QuantConfigError(f"quantization_config.rotation={qc['rotation']!r} (rotated weights) is not supported")
    if method == "fp8":
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
        return QuantScheme("fp8", lm_head=lm_head)
    if method != "gptq":
        raise QuantConfigError(f"quantization_config.quant_method={method!r} is not supported "
                               "(supported: 'gptq' 4-bit, 'fp8' per-channel)")
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
    scheme = QuantScheme("gptq", group_size=gs, sym=_as_bool(qc, "sym", True),
                         desc_act=_as_bool(qc, "desc_act", False), checkpoint_format=fmt, lm_head=lm_head)
    _check_dynamic(qc.get("dynamic"), {"bits": 4, "group_size": gs, "sym": scheme.sym,
                                       "desc_act": scheme.desc_act, "pack_dtype": "int32",
                                       "checkpoint_format": fmt, "format": fmt})
    return scheme


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
    """What the engine loads: the checkpoint's scheme, or quantize-on-load of `requested` (lm_head:
    quantize lm_head too, on load only)."""
    if requested is not None and requested not in ENGINE_CHOICES:
        raise QuantConfigError(f"quantization must be one of {', '.join(ENGINE_CHOICES)} (or unset), "
                               f"got {requested!r}")
    qc = checkpoint_quant_config(model_dir, config_extra)
    found = parse_quant_config(qc) if qc is not None else None
    if found is not None:
        ok = requested is None or (requested == "fp8") == (found.method == "fp8")
        if not ok:
            raise QuantConfigError(f"the checkpoint is {found.engine_name}-quantized "
                                   f"(quant_method {found.method!r}) but quantization={requested!r} was requested")
        if lm_head and not found.lm_head:
            raise QuantConfigError("this checkpoint is already quantized with lm_head in bf16; quantize_lm_head "
                                   "applies to quantize-on-load of a bf16 checkpoint only (prepare-model "
                                   "--quantize-lm-head writes one with lm_head quantized)")
        return found
    if requested is None:
        if lm_head:
            raise QuantConfigError("quantize_lm_head needs quantization fp8 or w4a16 (this checkpoint is unquantized)")
        return None
    if requested == "gptq":
        raise QuantConfigError("quantization='gptq' needs a GPTQ checkpoint, but this one is unquantized: "
                               "run `salaserve prepare-model --quant w4a16-gptq`, or use quantization='w4a16' "
                               "to quantize on load (round-to-nearest)")
    if requested == "fp8":
        return QuantScheme("fp8", lm_head=lm_head, stored=False)
    return QuantScheme("gptq", lm_head=lm_head, stored=False)  # w4a16 on load: RTN, group 128, symmetric


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
