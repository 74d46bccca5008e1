"""A MiniCPM-SALA checkpoint's tensors: names and shapes (spec section 5), shard files, the check
that a checkpoint matches its config, and deterministic random values.

The layout is the contract between everything that reads or writes weights: the loader, the
quantized-checkpoint loader and writer (quant/), the random-checkpoint writer and the small-model
trainer. Random values serve `load_format="dummy"` (made directly on the target device) and
random checkpoints on disk.
"""

from __future__ import annotations

import json
import math
import os
import zlib

import torch

from salaserve.config import ModelConfig

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


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint with its shape, in a stable order (spec section 5)."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if cfg.is_sparse_layer(i):
            shapes[a + "q_proj.weight"] = (cfg.q_size, h)
            shapes[a + "k_proj.weight"] = (cfg.kv_size, h)
            shapes[a + "v_proj.weight"] = (cfg.kv_size, h)
            shapes[a + "o_proj.weight"] = (h, cfg.q_size)
            shapes[a + "o_gate.weight"] = (cfg.q_size, h)
        else:
            ls, d = cfg.lightning_size, cfg.lightning_head_dim
            for name in ("q_proj", "k_proj", "v_proj", "z_proj"):
                shapes[a + name + ".weight"] = (ls, h)
            shapes[a + "o_proj.weight"] = (h, ls)
            shapes[a + "q_norm.weight"] = (d,)
            shapes[a + "k_norm.weight"] = (d,)
            shapes[a + "o_norm.weight"] = (ls,)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed, so that each tensor is the same whatever order tensors are made in."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_std(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> float:
    """Scales chosen so that random-weight activations stay O(1) through all layers and the
    logits are spread (std ~2), not degenerate."""
    if name == "model.embed_tokens.weight":
        return 1.0 / cfg.scale_emb  # h0 = E * scale_emb has unit scale
    if name == "lm_head.weight":
        return 2.0 * cfg.logit_divisor / math.sqrt(cfg.hidden_size)
    return 1.0 / math.sqrt(shape[1])  # linear [out, in]: unit-variance outputs


def random_tensor(cfg: ModelConfig, name: str, shape: tuple[int, ...], seed: int,
                  dtype: torch.dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    if len(shape) == 1:  # norm weights: near 1, but not exactly, so a dropped weight shows up
        x = 1.0 + 0.1 * x
    else:
        x = x * init_std(cfg, name, shape)
    return x.to(dtype)


def random_state_dict(cfg: ModelConfig, seed: int = 0, dtype=torch.bfloat16, device="cpu") -> dict:
    return {name: random_tensor(cfg, name, shape, seed, dtype, device)
            for name, shape in expected_shapes(cfg).items()}
