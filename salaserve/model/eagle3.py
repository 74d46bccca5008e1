"""The EAGLE-3 draft head: one decoder layer over the target's low/middle/high hidden states.

Checkpoint format: the HF-style one SGLang loads for EAGLE-3 heads (`LlamaForCausalLMEagle3`):
config.json with "architectures": ["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size
and eagle_config.eagle_aux_hidden_state_layer_ids; model.safetensors with `fc.weight`
[hidden, 3*target_hidden], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2*hidden inputs), `midlayer.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight` [draft_vocab, hidden], `d2t` (int64: target id - draft id, per draft
id) and `t2d` (bool over the target vocab: which target ids the draft can propose).

Choices (documented in docs/eagle3.md):
  - `eagle_aux_hidden_state_layer_ids` name decoder layers whose *output* (the residual stream after
    the layer) is captured, as in SGLang (which captures the input of layer id + 1). Default as
    SGLang: [1, L//2 - 1, L - 4].
  - The token embedding is the target's, scaled by its scale_emb as the target applies it; it is
    not stored in the head's checkpoint (SGLang shares the target's embedding the same way). The
    scale only moves the RMSNorm's epsilon, so a head trained without it loads the same.
  - The head always has its own lm_head over the reduced draft vocabulary (no reuse of the
    target's: the draft's final hidden is not the target's, and a small vocab keeps it small).
  - Step j of a draft runs at position p + j - 1, p = the position of the last target hidden
    state: training and drafting agree on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from salaserve.model.reference import rope_cos_sin

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """SGLang's default EAGLE-3 capture: the outputs of layers 1, L//2 - 1 and L - 4 (clamped)."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    # prompt positions the head was trained to attend to before its first draft (salaserve's key
    # "prompt_context"; None: not said, e.g. heads trained on whole sequences): serving hands the
    # drafter no more of the prompt than that (Engine._load_eagle_head)
    prompt_context: int | None = None
    extra: dict = field(default_factory=dict)  # other config.json keys, kept on save

    @classmethod
    def for_target(cls, tcfg, draft_vocab_size: int | None = None, aux_layer_ids=None) -> "Eagle3Config":
        """A head shaped like one decoder layer of the target (a ModelConfig)."""
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                   num_attention_heads=tcfg.num_attention_heads, num_key_value_heads=tcfg.num_key_value_heads,
                   head_dim=tcfg.head_dim, vocab_size=tcfg.vocab_size,
                   draft_vocab_size=draft_vocab_size or tcfg.vocab_size, target_hidden_size=tcfg.hidden_size,
                   aux_layer_ids=tuple(aux_layer_ids or default_aux_layers(tcfg.num_hidden_layers)),
                   rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta,
                   max_position_embeddings=tcfg.max_position_embeddings)

    def to_dict(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "num_hidden_layers": 1, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
            "attention_bias": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        })
        if self.prompt_context is not None:
            d["prompt_context"] = self.prompt_context
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "Eagle3Config":
        if ARCHITECTURE not in (d.get("architectures") or []):
            raise ValueError(f"{where}: not an EAGLE-3 head: architectures is {d.get('architectures')!r}, "
                             f"expected [{ARCHITECTURE!r}]")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{where}: num_hidden_layers {d['num_hidden_layers']}: only 1-layer heads are supported")
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or d.get("eagle_aux_hidden_state_layer_ids")
        if not aux or len(aux) != 3:
            raise ValueError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must list 3 layers, got {aux!r}")
        try:
            hidden = int(d["hidden_size"])
            known = dict(
                hidden_size=hidden, intermediate_size=int(d["intermediate_size"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
                head_dim=int(d.get("head_dim") or hidden // int(d["num_attention_heads"])),
                vocab_size=int(d["vocab_size"]),
                draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
                target_hidden_size=int(d.get("target_hidden_size") or hidden),
                aux_layer_ids=tuple(int(i) for i in aux), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)))
            if d.get("prompt_context") is not None:
                known["prompt_context"] = int(d["prompt_context"])
        except KeyError as e:
            raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
        extra = {k: v for k, v in d.items() if k not in cls(**known).to_dict() and k != "prompt_context"}
        return cls(**known, extra=extra)


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = _linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = _linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = _linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = _linear(c.num_attention_heads * c.head_dim, c.hidden_size)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = _linear(c.hidden_size, c.intermediate_size)
        self.up_proj = _linear(c.hidden_size, c.intermediate_size)
        self.down_proj = _linear(c.intermediate_size, c.hidden_size)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the fused target hidden state
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX RoPE on x [..., T, H, d] at positions [..., T] (the reference model's rotation)."""
    cos, sin = rope_cos_sin(positions.reshape(-1), x.shape[-1], theta)
    cos = cos.reshape(*positions.shape, 1, x.shape[-1])
    sin = sin.reshape(*positions.shape, 1, x.shape[-1])
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Eagle3Head(nn.Module):
    """Parameters carry the checkpoint's names (state_dict() is the safetensors content)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.fc = _linear(3 * cfg.target_hidden_size, cfg.hidden_size)
        self.midlayer = _MidLayer(cfg)
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = _linear(cfg.hidden_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool)
                             if cfg.draft_vocab_size == cfg.vocab_size else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed: torch.Tensor | None = None  # the target's, set by attach_target (not saved)
        self.embed_scale = 1.0

    def attach_target(self, embed: torch.Tensor, scale_emb: float) -> None:
        if embed.shape != (self.cfg.vocab_size, self.cfg.target_hidden_size):
            raise ValueError(f"EAGLE-3 head: the target's embedding is {tuple(embed.shape)}, the head expects "
                             f"[{self.cfg.vocab_size}, {self.cfg.target_hidden_size}] (vocab_size, target_hidden_size)")
        if self.cfg.hidden_size != self.cfg.target_hidden_size:
            raise ValueError("EAGLE-3 head: hidden_size != target_hidden_size: the target's embedding cannot be shared")
        self.embed, self.embed_scale = embed, float(scale_emb)

    def set_vocab_map(self, draft_to_target: torch.Tensor) -> None:
        """draft id i proposes target id draft_to_target[i] (sorted, distinct)."""
        ids = draft_to_target.long().to(self.d2t.device)
        if ids.numel() != self.cfg.draft_vocab_size:
            raise ValueError(f"{ids.numel()} draft ids for draft_vocab_size {self.cfg.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed[ids] * self.embed_scale).to(self.fc.weight.dtype)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states [..., 3*target_hidden] -> the draft's hidden [..., hidden]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def layer(self, emb, hidden, positions, past_k=None, past_v=None, mask=None):
        """The decoder layer. emb, hidden [B, T, H]; positions [B, T]; past_k/past_v [B, P, Hkv, d]
        (earlier keys, RoPE applied); mask [B, T, P+T] bool (keys each query sees; a query must see
        itself). Returns (hidden out [B, T, H]: the pre-norm residual stream the next step feeds
        back, k [B, T, Hkv, d], v)."""
        c, m = self.cfg, self.midlayer
        B, T, _ = hidden.shape
        x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)
        a = m.self_attn
        q = _rope(a.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim), positions, c.rope_theta)
        k = _rope(a.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim), positions, c.rope_theta)
        v = a.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        keys = k if past_k is None else torch.cat([past_k, k], dim=1)
        vals = v if past_v is None else torch.cat([past_v, v], dim=1)
        if mask is None:  # causal over this call, everything before it visible
            P = keys.shape[1] - T
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P).expand(B, T, P + T)
        group = c.num_attention_heads // c.num_key_value_heads
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2).float(), keys.repeat_interleave(group, dim=2).transpose(1, 2).float(),
            vals.repeat_interleave(group, dim=2).transpose(1, 2).float(), attn_mask=mask[:, None])
        o = o.transpose(1, 2).reshape(B, T, -1).to(x.dtype)
        h = hidden + a.o_proj(o)
        return h + m.mlp(m.post_attention_layernorm(h)), k, v

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits (fp32) of the layer's output hidden states."""
        return self.lm_head(self.norm(hidden)).float()


def init_head(cfg: Eagle3Config, seed: int = 0, std: float = 0.02) -> Eagle3Head:
    """Random weights (normal, std), unit norms; identity vocab map when the vocabs are equal."""
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    if cfg.draft_vocab_size == cfg.vocab_size:
        head.set_vocab_map(torch.arange(cfg.vocab_size))
    return head


def save_eagle3(head: Eagle3Head, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors (floats in dtype; d2t int64, t2d bool)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = head.cfg.to_dict()
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in head.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def load_eagle3(path: str, dtype: torch.dtype = torch.float32, device="cpu", target_cfg=None) -> Eagle3Head:
    """Load a head; ValueError naming what is wrong for a missing, foreign or mismatched
    checkpoint (target_cfg: the target's ModelConfig, checked against the head's vocab, hidden
    size and capture layers)."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"EAGLE-3 draft model {path!r}: no config.json there")
    with open(cfg_path) as f:
        cfg = Eagle3Config.from_dict(json.load(f), where=cfg_path)
    if target_cfg is not None:
        _check_target(cfg, target_cfg, path)
    wpath = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        raise ValueError(f"EAGLE-3 draft model {path!r}: no {WEIGHTS_FILE} there")
    tensors = load_file(wpath)
    tensors.pop("embed_tokens.weight", None)  # some heads carry a copy of the target's; we share it
    head = Eagle3Head(cfg)
    want = head.state_dict()
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 draft model {path!r}: tensors do not match the config: missing {missing}, "
                         f"unexpected {unexpected}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(want[name].shape):
            raise ValueError(f"EAGLE-3 draft model {path!r}: {name} has shape {tuple(t.shape)}, the config "
                             f"gives {tuple(want[name].shape)}")
    head.load_state_dict({k: v.to(want[k].dtype) for k, v in tensors.items()})
    return head.to(device=device, dtype=dtype).eval()


def _check_target(cfg: Eagle3Config, t, path: str) -> None:
    problems = []
    if cfg.vocab_size != t.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != the target's {t.vocab_size}")
    if cfg.target_hidden_size != t.hidden_size:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != the target's hidden_size {t.hidden_size}")
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        problems.append(f"aux layers {bad} outside the target's {t.num_hidden_layers} layers")
    if problems:
        raise ValueError(f"EAGLE-3 draft model {path!r} does not fit this target: " + "; ".join(problems))
