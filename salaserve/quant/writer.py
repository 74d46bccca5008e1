"""Writes a processed model directory: sharded safetensors as tensors arrive, the index, the
config with its `quantization_config`, `quantize_config.json`, and every other file of the input
(tokenizer files, chat template, custom code, generation config), so that the output is a complete
model directory the engine (and HF tooling) can load on its own.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from salaserve.core.weights import INDEX_FILE
from salaserve.quant.scheme import QUANTIZE_CONFIG_FILE


class ShardWriter:
    """Collects tensors into shards of at most max_shard_bytes (a bigger tensor gets its own)."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 4 * 2**30):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # temporary file name, tensor names
        self.total_bytes = 0
        os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name} written twice")
        t = t.detach().to("cpu", copy=True).contiguous()  # own storage: safetensors refuses shared ones
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        tmp = f"shard-{len(self._shards):05d}.tmp.safetensors"
        save_file(self._pending, os.path.join(self.out_dir, tmp), metadata={"format": "pt"})
        self._shards.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Name the shards model-0000i-of-0000n.safetensors and write the index."""
        self._flush()
        weight_map = {}
        n = len(self._shards)
        for i, (tmp, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".bin") or name in (INDEX_FILE,
                                                                             "pytorch_model.bin.index.json")


def copy_model_files(in_dir: str, out_dir: str) -> list[str]:
    """Every top-level non-weight file of the input except config.json / quantize_config.json
    (written fresh): tokenizer, chat template, generation config, custom code."""
    copied = []
    for name in sorted(os.listdir(in_dir)):
        src = os.path.join(in_dir, name)
        if (not os.path.isfile(src) or _is_weight_file(name)
                or name in ("config.json", QUANTIZE_CONFIG_FILE)):
            continue
        shutil.copy2(src, os.path.join(out_dir, name))
        copied.append(name)
    return copied


def write_configs(in_dir: str, out_dir: str, quant_config: dict) -> None:
    """config.json = the input's, fields untouched, plus quantization_config; quantize_config.json
    = the same object (what GPTQModel / AutoGPTQ look for next to the weights)."""
    with open(os.path.join(in_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quant_config
    for name, obj in (("config.json", config), (QUANTIZE_CONFIG_FILE, quant_config)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
