"""Writes complete HF-format MiniCPM-SALA model directories with random weights.

The real 18 GB checkpoint cannot be downloaded here, so tests and benchmarks run on checkpoints
written by this module in the exact layout of the release: config.json, generation_config.json,
sharded safetensors with model.safetensors.index.json, and tokenizer files with a chat template.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from salaserve.config import ModelConfig, preset_config
from salaserve.core.weights import INDEX_FILE, expected_shapes, random_tensor

DEFAULT_SHARD_BYTES = {"tiny": 4 * 2**20, "full": 4 * 2**30}


def write_config_files(out_dir: str, cfg: ModelConfig) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    generation = {
        "_from_model_config": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id),
        "pad_token_id": cfg.pad_token_id,
        "transformers_version": cfg.extra.get("transformers_version", "4.56.1"),
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
        f.write("\n")


def write_weights(out_dir: str, cfg: ModelConfig, seed: int, max_shard_bytes: int,
                  dtype=torch.bfloat16) -> int:
    """Random weights in shards of at most max_shard_bytes (a tensor larger than that gets a shard
    of its own). Tensors are made one shard at a time, so the whole model is never resident."""
    shapes = expected_shapes(cfg)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    total = 0
    weight_map = {}
    for i, names in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_tensor(cfg, n, shapes[n], seed, dtype, "cpu") for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, os.path.join(out_dir, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in names})
        del tensors
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    return total


def write_checkpoint(out_dir: str, preset: str | ModelConfig = "tiny", seed: int = 0,
                     weights: bool = True, max_shard_bytes: int | None = None) -> ModelConfig:
    """Write a full model directory. `preset` is 'tiny', 'full' or a ModelConfig."""
    from salaserve.model.tokenizer import write_tokenizer

    cfg = preset_config(preset) if isinstance(preset, str) else preset
    name = preset if isinstance(preset, str) else "full"
    write_config_files(out_dir, cfg)
    write_tokenizer(out_dir, cfg.vocab_size)
    if weights:
        write_weights(out_dir, cfg, seed, max_shard_bytes or DEFAULT_SHARD_BYTES.get(name, 4 * 2**30))
    return cfg
