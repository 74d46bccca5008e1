"""A batched [B, T] training forward of the MiniCPM-SALA architecture, with autograd.

`ReferenceModel` is the executable spec but runs one sequence at a time; this module computes the
same function for a whole batch of equal-length sequences, each a fresh sequence starting at
position 0 (one-shot prefill). tests/test_train_small.py checks that its fp32 logits equal the
reference's on the same weights, dense and sparse lengths alike: that equality is what makes the
trained weights mean the same thing in the serving engine.

Parameter names are exactly the HF tensor names of `salaserve.core.weights.expected_shapes`,
so `state_dict()` is a checkpoint.

Shared math, taken from `salaserve.model.reference` rather than re-derived: RMSNorm, RoPE, the
InfLLM-v2 key compression, stage-1 scores and block selection (batched by folding the batch into
the head axis: query head b*Hq+h maps to KV head (b*Hq+h)//group = b*Hkv+h//group). New here:
the Lightning GLA in a fully parallel chunked form (no per-token or per-chunk Python loop) and
the attention through `F.scaled_dot_product_attention` with the selected-block mask.

The block selection is not differentiable (as in InfLLM-v2 training): the mask is computed
without grad, gradients flow through the attention over the selected blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from salaserve.config import ModelConfig
from salaserve.core.weights import expected_shapes
from salaserve.model import reference as spec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return spec.rms_norm(x, self.weight, self.eps)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------
# Sparse (InfLLM-v2) attention layer (spec section 3)
# ---------------------------------------------------------------------------------------------


# Flash (causal) / memory-efficient (arbitrary mask) kernels, math as the fallback. cuDNN is left
# out: its mask support has varied between torch versions, and these shapes do not need it.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.no_grad()
def infllm_v2_mask(q: torch.Tensor, k: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Which keys each query may read on the InfLLM-v2 path of a one-shot prefill (spec 3.3-3.5).

    q [B, T, Hq, d], k [B, T, Hkv, d]. Returns a bool mask [B, Hkv, T, T]: the selected blocks
    (init + local + top-k by the C2-normalised stage-1 scores) intersected with causality.
    The reference's functions do the work, with the batch folded into the head axis.
    """
    sc = cfg.sparse
    B, T, Hq, d = q.shape
    hkv = k.shape[2]
    qf = q.transpose(0, 1).reshape(T, B * Hq, d)
    kf = k.transpose(0, 1).reshape(T, B * hkv, d)
    c1 = spec.compress_keys(kf, sc.kernel_size, sc.kernel_stride)
    c2 = spec.compress_keys(kf, sc.c2_kernel_size, sc.c2_kernel_stride)
    pos = torch.arange(T, device=q.device)
    vis1 = spec.visible_count(pos, sc.kernel_size, sc.kernel_stride, c1.shape[0])
    vis2 = spec.visible_count(pos, sc.c2_kernel_size, sc.c2_kernel_stride, c2.shape[0])
    with torch.autocast(q.device.type, enabled=False):  # scores in fp32 as the reference (autocast would use bf16)
        scores = spec.stage1_scores(qf, c1, c2, vis1, vis2, Hq // hkv, cfg.head_dim ** -0.5)
    num_blocks = -(-T // sc.block_size)
    blocks = spec.select_blocks(scores, pos // sc.block_size, num_blocks, sc)  # [B*Hkv, T, nb]
    allowed = blocks.repeat_interleave(sc.block_size, dim=-1)[..., :T]
    allowed &= pos[None, :] <= pos[:, None]
    return allowed.view(B, hkv, T, T)


class SparseAttention(nn.Module):
    """NoPE GQA attention with an output gate; dense below dense_len, InfLLM-v2 at and beyond."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.q_proj = _linear(h, cfg.q_size)
        self.k_proj = _linear(h, cfg.kv_size)
        self.v_proj = _linear(h, cfg.kv_size)
        self.o_proj = _linear(cfg.q_size, h)
        self.o_gate = _linear(h, cfg.q_size)

    def forward(self, a):
        cfg = self.cfg
        B, T, _ = a.shape
        Hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        group = Hq // hkv
        q = self.q_proj(a).view(B, T, Hq, d)
        k = self.k_proj(a).view(B, T, hkv, d)
        v = self.v_proj(a).view(B, T, hkv, d)
        # SDPA layout [B, H, T, d]; KV heads repeated to the query heads (GQA h -> h // group).
        qt = q.transpose(1, 2)
        kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
        vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
        with sdpa_kernel(SDPA_BACKENDS):
            if T < cfg.sparse.dense_len:  # the whole call is dense (spec 3.2: decided by total length)
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            else:
                allowed = infllm_v2_mask(q.detach(), k.detach(), cfg)  # [B, Hkv, T, T]
                allowed = allowed[:, :, None].expand(B, hkv, group, T, T).reshape(B, Hq, T, T)
                o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed)
        o = o.transpose(1, 2).reshape(B, T, Hq * d)
        return self.o_proj(o * torch.sigmoid(self.o_gate(a)))


# ---------------------------------------------------------------------------------------------
# Lightning layer: simple GLA (spec section 4)
# ---------------------------------------------------------------------------------------------


def gla_parallel(q, k, v, log_decay, scale, chunk_size: int = 64):
    """Simple GLA from a zero state, all chunks at once (spec 4.5). q, k, v [B, T, H, d] fp32;
    log_decay [H] (= -slope). Returns o [B, T, H, d] fp32.

    Same chunking as `reference.gla_chunked`, but the chunk-to-chunk recurrence of the state is
    unrolled into one matrix product: the decay is data-independent, so the state entering chunk
    n is S_n = sum_{m<n} g^(C*(n-1-m)) * Delta_m, where Delta_m is chunk m's own contribution.
    Zero padding at the end only adds positions after the real ones, which no real output reads.
    """
    B, T, H, d = q.shape
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    # [B, H, N, C, d]
    q, k, v = (x.view(B, n, C, H, d).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g = log_decay.float().to(q.device)
    idx = torch.arange(C, device=q.device, dtype=torch.float32)
    rel = idx[:, None] - idx[None, :]  # tau - s
    decay = torch.where(rel >= 0, torch.exp(g[:, None, None] * rel.clamp(min=0)), 0.0)  # [H, C, C]
    intra = ((q @ k.transpose(-1, -2)) * decay[None, :, None]) @ v
    # Delta_m = sum_s g^(C-1-s) k_s^T v_s (0-based s): the chunk's state contribution at its end.
    k_decay = torch.exp(g[:, None, None] * (C - 1 - idx)[None, :, None])  # [H, C, 1]
    delta = (k * k_decay[None, :, None]).transpose(-1, -2) @ v  # [B, H, N, d, d]
    m = torch.arange(n, device=q.device, dtype=torch.float32)
    lag = m[:, None] - 1 - m[None, :]  # n - 1 - m
    carry = torch.where(lag >= 0, torch.exp(g[:, None, None] * C * lag.clamp(min=0)), 0.0)  # [H, N, N]
    state_in = torch.einsum("hnm,bhmij->bhnij", carry, delta)  # state entering each chunk
    q_decay = torch.exp(g[:, None, None] * (idx + 1)[None, :, None])  # g^tau, tau 1-based
    inter = (q * q_decay[None, :, None]) @ state_in
    o = scale * (intra + inter)  # [B, H, N, C, d]
    return o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, d)[:, :T]


class LightningAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, ls, d = cfg.hidden_size, cfg.lightning_size, cfg.lightning_head_dim
        self.q_proj = _linear(h, ls)
        self.k_proj = _linear(h, ls)
        self.v_proj = _linear(h, ls)
        self.o_proj = _linear(ls, h)
        self.z_proj = _linear(h, ls)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_norm = RMSNorm(ls, cfg.rms_norm_eps)
        self.register_buffer("log_decay", -torch.tensor(cfg.lightning_slopes(), dtype=torch.float32),
                             persistent=False)

    def forward(self, a):
        cfg = self.cfg
        B, T, _ = a.shape
        H, d = cfg.lightning_nh, cfg.lightning_head_dim
        q = self.q_norm(self.q_proj(a).view(B, T, H, d))  # per head, before RoPE
        k = self.k_norm(self.k_proj(a).view(B, T, H, d))
        v = self.v_proj(a).view(B, T, H, d)
        cos, sin = spec.rope_cos_sin(torch.arange(T, device=a.device), d, cfg.rope_theta)
        q, k = spec.apply_rope(q, cos, sin), spec.apply_rope(k, cos, sin)  # [T, 1, d] broadcasts over B
        with torch.autocast(a.device.type, enabled=False):  # the recurrence runs in fp32 (spec 4.4)
            o = gla_parallel(q.float(), k.float(), v.float(), self.log_decay, cfg.lightning_attn_scale)
        o = self.o_norm(o.reshape(B, T, H * d))  # one group over H*d
        return self.o_proj(o * torch.sigmoid(self.z_proj(a)))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dropout: float):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SparseAttention(cfg) if cfg.is_sparse_layer(layer) else LightningAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.residual_scale = cfg.residual_scale
        # Dropout on the branch outputs: a training-only regulariser, the identity at inference.
        self.dropout = nn.Dropout(dropout)

    def forward(self, h):
        r = self.residual_scale
        h = h + self.dropout(self.self_attn(self.input_layernorm(h))) * r
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h))) * r


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dropout: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dropout) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TrainModel(nn.Module):
    """MiniCPM-SALA for training: `forward(ids [B, T]) -> logits [B, T, vocab]` (fp32)."""

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, dropout)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        names = {n: tuple(p.shape) for n, p in self.named_parameters()}
        if names != expected_shapes(cfg):  # the checkpoint layout is the contract with the loader
            raise AssertionError("TrainModel parameters do not match weights.expected_shapes")

    def hidden_states(self, input_ids):
        cfg = self.cfg
        h = self.model.embed_tokens(input_ids) * cfg.scale_emb  # muP: embedding x scale_emb
        for layer in self.model.layers:
            h = layer(h)
        return self.model.norm(h)

    def forward(self, input_ids):
        z = self.hidden_states(input_ids)
        return self.lm_head(z / self.cfg.logit_divisor).float()  # muP: logits / (hidden / dim_model_base)

    def loss(self, input_ids, targets, reduction: str = "mean"):
        """Next-token cross-entropy (nats); targets < 0 are ignored."""
        logits = self(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)

    # ---- initialisation and checkpoints ------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int, init_std: float = 0.02) -> None:
        """Seeded init in name order (independent of module construction order).

        Linear weights ~ N(0, init_std^2 / width_mult) (muP: hidden weights shrink with width),
        the embedding so that embed * scale_emb has unit scale, the lm_head so that the first
        logits are small (near-uniform predictions), norm weights 1.
        """
        cfg = self.cfg
        width_mult = cfg.hidden_size / cfg.dim_model_base
        gen = torch.Generator().manual_seed(seed)
        for name, p in sorted(self.named_parameters()):
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            if name == "model.embed_tokens.weight":
                std = 1.0 / cfg.scale_emb
            elif name == "lm_head.weight":
                std = 0.5 * cfg.logit_divisor / math.sqrt(cfg.hidden_size)  # logits ~ N(0, 0.5^2)
            else:
                std = init_std / math.sqrt(width_mult)
            p.copy_(torch.randn(p.shape, generator=gen) * std)

    def load_hf_state_dict(self, weights: dict) -> None:
        self.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)

    def hf_state_dict(self, dtype=torch.bfloat16) -> dict:
        return {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
