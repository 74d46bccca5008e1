"""Tensor names, shapes and random initialisation of a MiniCPM-SALA checkpoint (spec section 5).

Shared by the checkpoint writer (random weights on disk) and the loader (`load_format="dummy"`,
random weights made directly on the target device).
"""

from __future__ import annotations

import math
import zlib

import torch

from salaserve.config import ModelConfig


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
