"""Checkpoint tensors by HF name, one at a time: the input side of offline quantization.

prepare-model and the layer-by-layer GPTQ never hold the whole bf16 model: they ask for the
tensors of one decoder layer, quantize them and let them go. Dummy weights (`load_format="dummy"`)
are made per name with the loader's own generator, so a quantized dummy model is the quantized
version of exactly the weights `load_format="dummy"` serves.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from salaserve.config import ModelConfig
from salaserve.core.weights import checkpoint_files, expected_shapes, random_tensor


class TensorSource:
    def __init__(self, model_dir, cfg: ModelConfig, load_format: str = "auto", seed: int = 0):
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
        self.cfg = cfg
        self.seed = seed
        self.dummy = load_format == "dummy"
        self._file_of: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        if self.dummy:
            self._shapes = dict(expected_shapes(cfg))
            return
        for path in checkpoint_files(os.fspath(model_dir)):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    self._file_of[name] = path
                    self._shapes[name] = tuple(f.get_slice(name).get_shape())

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def get(self, name: str, device="cpu", dtype=None) -> torch.Tensor:
        """The tensor as stored (bf16 for dummy weights), on `device`, optionally cast."""
        if self.dummy:
            t = random_tensor(self.cfg, name, self._shapes[name], self.seed, torch.bfloat16, device)
        else:
            with safe_open(self._file_of[name], framework="pt", device=str(torch.device(device))) as f:
                t = f.get_tensor(name)
        return t if dtype is None else t.to(dtype)
