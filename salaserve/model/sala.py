"""The serving model: the reference math, batched over many sequences of different lengths.

Weights are fused at load time (q/k/v plus the layer's gate projection into one matrix, gate/up
into one), since they read the same normed input. All attention and Lightning work goes through
a kernel backend (`salaserve.kernels`), and every cache access through one ForwardBatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.cache.state import StatePool
from salaserve.config import ModelConfig
from salaserve.core.batch import ForwardBatch
from salaserve.parallel.shard import head_range, local_config
from salaserve.quant.fuse import fuse_linear


@dataclass
class Caches:
    kv: KVPool
    compressed: CompressedKeyPool
    states: StatePool


def fuse_state_dict(cfg: ModelConfig, w: dict) -> dict:
    """HF tensor names -> the serving model's fused parameters (the input dict is consumed).
    Quantized linears fuse too, or stay split where their formats differ (quant/fuse.py)."""
    fused = {
        "embed": w.pop("model.embed_tokens.weight"),
        "final_norm": w.pop("model.norm.weight"),
        "lm_head": w.pop("lm_head.weight"),
        "layers": [],
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = {
            "input_norm": w.pop(p + "input_layernorm.weight"),
            "post_norm": w.pop(p + "post_attention_layernorm.weight"),
            "gate_up": fuse_linear([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")]),
            "down": w.pop(p + "mlp.down_proj.weight"),
            "o_proj": w.pop(a + "o_proj.weight"),
        }
        if cfg.is_sparse_layer(i):
            names = ("q_proj", "k_proj", "v_proj", "o_gate")
        else:
            names = ("q_proj", "k_proj", "v_proj", "z_proj")
            layer["q_norm"] = w.pop(a + "q_norm.weight")
            layer["k_norm"] = w.pop(a + "k_norm.weight")
            layer["o_norm"] = w.pop(a + "o_norm.weight")
        layer["qkvg"] = fuse_linear([w.pop(a + n + ".weight") for n in names])
        fused["layers"].append(layer)
    return fused


class SalaModel:
    def __init__(self, cfg: ModelConfig, fused: dict, backend, dtype: torch.dtype, device, tp_rank: int = 0,
                 tp_size: int = 1):
        """cfg: the checkpoint's config. Tensor parallelism (tp_size > 1): `fused` holds this
        rank's shard (parallel/shard.py), the backend sums partial outputs over the ranks
        (parallel/ops.py), and self.cfg is this rank's view of the model (its head counts)."""
        self.cfg = local_config(cfg, tp_rank, tp_size)
        self.p = fused
        self.ops = backend
        self.dtype = dtype
        self.device = torch.device(device)
        # index of each layer inside its kind's cache tensors
        self.sparse_index = {layer: i for i, layer in enumerate(cfg.sparse_layers)}
        self.lightning_index = {layer: i for i, layer in enumerate(cfg.lightning_layers)}
        # the decay of each of this rank's heads by its global index (not the slopes of a model
        # with fewer heads)
        slopes = torch.tensor(cfg.lightning_slopes(), dtype=torch.float32, device=self.device)
        self.log_decay = -slopes[head_range(cfg.lightning_nh, tp_rank, tp_size)]

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, caches: Caches, aux_layers: tuple[int, ...] | None = None,
                aux_rows: torch.Tensor | None = None):
        """Run every token of the batch through the model; fp32 logits of the rows in
        batch.logits_indices, [M, vocab]. With aux_layers (EAGLE-3): (logits, aux [M + E, len*hidden]),
        aux = the residual stream after each named layer at those rows and then at the E rows of
        aux_rows (the drafter's prompt context: no logits), concatenated in order."""
        cfg, ops, p = self.cfg, self.ops, self.p
        eps, r = cfg.rms_norm_eps, cfg.residual_scale
        # per-step derived tensors are recomputed by every forward: a graph capture must record
        # their computation, not reuse tensors left by a warm-up run
        batch.derived = {}
        layers = p["layers"]
        h = (p["embed"][batch.input_ids] * cfg.scale_emb).to(self.dtype)
        # Each layer: qkvg = linear(rms_norm(h)); o = mixer(qkvg); h += o_proj(o) * r;
        # h += down(silu_mul(gate_up(rms_norm(h)))) * r. The junction ops let the backend fuse
        # every norm and residual add into the neighbouring linears, and silu_mul into gate_up's
        # output or down's input (silu_after_gate_up says which).
        proj = ops.norm_linear(h, layers[0]["input_norm"], eps, layers[0]["qkvg"])
        silu_first = ops.silu_after_gate_up(h.shape[0])  # which junction applies the MLP's silu_mul
        captured = {}
        rows = batch.logits_indices
        if aux_layers and aux_rows is not None and aux_rows.numel():
            rows = torch.cat([rows, aux_rows])
        for i, layer in enumerate(layers):
            if cfg.is_sparse_layer(i):
                o = self._sparse_mixer(self.sparse_index[i], proj, batch, caches)
            else:
                o = self._lightning_mixer(self.lightning_index[i], layer, proj, batch, caches)
            h, gate_up = ops.residual_norm_linear(h, o, layer["o_proj"], r, layer["post_norm"], eps, layer["gate_up"],
                                                  silu_out=silu_first)
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            h, proj = ops.residual_norm_linear(h, gate_up, layer["down"], r, nxt and nxt["input_norm"], eps,
                                               nxt and nxt["qkvg"], silu=not silu_first)
            if aux_layers and i in aux_layers:  # only the rows asked for: a few rows' copy
                captured[i] = h[rows]
        z = ops.rms_norm(h[batch.logits_indices], p["final_norm"], eps)
        logits = ops.linear(z / cfg.logit_divisor, p["lm_head"]).float()
        if aux_layers:
            return logits, torch.cat([captured[i] for i in aux_layers], dim=-1)
        return logits

    def _sparse_mixer(self, idx, qkvg, batch, caches):
        """qkvg: the layer's fused q/k/v/gate projection -> the attention output times the gate
        (the o_proj input)."""
        cfg, ops = self.cfg, self.ops
        n, d = qkvg.shape[0], cfg.head_dim
        q, k, v, gate = qkvg.split([cfg.q_size, cfg.kv_size, cfg.kv_size, cfg.q_size], dim=-1)
        k = k.reshape(n, cfg.num_key_value_heads, d)
        v = v.reshape(n, cfg.num_key_value_heads, d)
        ops.store_kv(caches.kv, idx, k, v, batch)
        ops.update_compressed(caches.kv, caches.compressed, idx, batch)
        return ops.sparse_attention_gated(q.reshape(n, cfg.num_attention_heads, d), caches.kv, caches.compressed,
                                          idx, batch, cfg, gate)

    def _lightning_mixer(self, idx, layer, qkvz, batch, caches):
        """qkvz: the layer's fused q/k/v/z projection -> the gated, normed GLA output (the o_proj
        input)."""
        cfg, ops = self.cfg, self.ops
        n, H, d = qkvz.shape[0], cfg.lightning_nh, cfg.lightning_head_dim
        q, k, v, z = qkvz.split(cfg.lightning_size, dim=-1)
        o = ops.lightning_attention(q.reshape(n, H, d), k.reshape(n, H, d), v.reshape(n, H, d), layer["q_norm"],
                                    layer["k_norm"], batch, caches.states, idx, self.log_decay,
                                    cfg.lightning_attn_scale, cfg.rms_norm_eps, cfg.rope_theta)
        return ops.lightning_output(o, layer["o_norm"], z, cfg.rms_norm_eps, self.dtype)
