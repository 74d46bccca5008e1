"""The reference model run one decoder layer at a time over many sequences, with the inputs of
every linear: what layer-by-layer GPTQ calibrates on (and the quality checks measure with).

Each decoder layer is the reference math (salaserve/model/reference.py): RMSNorm, the layer's
mixer (`ReferenceModel._sparse_mixer` / `_lightning_mixer`, fresh per-sequence state), the
residual, `mlp`. The linears of a layer read four distinct inputs ("groups"):

    attn_in  q/k/v/o_gate (sparse) or q/k/v/z (lightning)   the input-normed hidden state
    o_proj   o_proj                                         the gated attention output
    mlp_in   gate/up                                        the post-attention-normed state
    down     down_proj                                      silu(gate) * up

The two inner inputs are taken from the reference code itself, without re-deriving its math:
the mixer and `mlp` are run with o_proj / down_proj replaced by an identity matrix, which makes
them return exactly their last linear's input (a product with 1 and sums of exact zeros), and the
real o_proj / down_proj are applied afterwards.
"""

from __future__ import annotations

from typing import Optional

import torch

from salaserve.config import ModelConfig
from salaserve.model import reference as spec
from salaserve.model.reference import ReferenceModel, ReferenceState
from salaserve.quant.gptq import HessianAccumulator

GROUPS = ("attn_in", "o_proj", "mlp_in", "down")


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def layer_linears(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Group -> HF weight names of layer i's linears that read that group's input."""
    a = layer_prefix(i) + "self_attn."
    m = layer_prefix(i) + "mlp."
    gate = "o_gate" if cfg.is_sparse_layer(i) else "z_proj"
    return {
        "attn_in": [a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj", gate)],
        "o_proj": [a + "o_proj.weight"],
        "mlp_in": [m + "gate_proj.weight", m + "up_proj.weight"],
        "down": [m + "down_proj.weight"],
    }


def in_features(cfg: ModelConfig, i: int, group: str) -> int:
    if group == "o_proj":
        return cfg.q_size if cfg.is_sparse_layer(i) else cfg.lightning_size
    return cfg.intermediate_size if group == "down" else cfg.hidden_size


def embed(cfg: ModelConfig, embed_weight: torch.Tensor, ids: list[int], dtype) -> torch.Tensor:
    """The reference model's first step: scaled token embeddings in the model dtype."""
    t = torch.as_tensor(ids, dtype=torch.long, device=embed_weight.device)
    return (embed_weight[t] * cfg.scale_emb).to(dtype)


class LayerRunner:
    """Runs decoder layers of the reference model on one device in one dtype."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self._eye: dict[int, torch.Tensor] = {}

    def _identity(self, n: int) -> torch.Tensor:
        if n not in self._eye:
            self._eye[n] = torch.eye(n, dtype=self.dtype, device=self.device)
        return self._eye[n]

    def new_accumulators(self, i: int) -> dict[str, HessianAccumulator]:
        return {g: HessianAccumulator(in_features(self.cfg, i, g), self.device) for g in GROUPS}

    @torch.no_grad()
    def run(self, i: int, w: dict, h: torch.Tensor,
            accs: Optional[dict[str, HessianAccumulator]] = None) -> torch.Tensor:
        """Layer i on one sequence's hidden states h [T, hidden] (positions 0..T-1) with weights
        `w` (this layer's HF names, any float dtype). Adds each linear group's input to `accs`
        when given. Returns the layer's output hidden states."""
        cfg, p = self.cfg, layer_prefix(i)
        w = {k: v.to(device=self.device, dtype=self.dtype) for k, v in w.items()}
        o_name, down_name = p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"
        probe = dict(w)
        probe[o_name] = self._identity(w[o_name].shape[1])
        model = ReferenceModel(cfg, probe, dtype=self.dtype, device=self.device)
        positions = torch.arange(h.shape[0], device=self.device)
        eps, r = cfg.rms_norm_eps, cfg.residual_scale

        a = spec.rms_norm(h, w[p + "input_layernorm.weight"], eps)
        mixer = model._sparse_mixer if cfg.is_sparse_layer(i) else model._lightning_mixer
        o = mixer(i, a, positions, ReferenceState())  # the gated attention output (o_proj = I)
        h = h + spec.linear(o, w[o_name]) * r
        b = spec.rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        probe[down_name] = self._identity(w[down_name].shape[1])
        g = spec.mlp(b, probe, p)  # silu(gate) * up (down_proj = I)
        out = h + spec.linear(g, w[down_name]) * r
        if accs is not None:
            for group, x in (("attn_in", a), ("o_proj", o), ("mlp_in", b), ("down", g)):
                accs[group].add(x)
        return out

    @torch.no_grad()
    def head_input(self, final_norm: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """What lm_head reads: the final RMSNorm over the divisor (ReferenceModel.forward)."""
        z = spec.rms_norm(h, final_norm.to(device=self.device, dtype=self.dtype), self.cfg.rms_norm_eps)
        return z / self.cfg.logit_divisor
