"""TensorParallelOps: a kernel backend whose ops see one rank's heads and add up across ranks.

It wraps the engine's backend (torch or triton) and changes the places where a rank's values
are partial:

  residual_norm_linear   the row-parallel linear (o_proj, down) gives this rank's share of the
                         output; one all-reduce sums it before the residual add, then the inner
                         backend's norm + next linear run on the full, identical residual stream.
                         That is the one all-reduce per block half (attention, MLP).
  lightning_output       the Lightning o_norm is one RMSNorm over all heads' outputs (spec 4.1),
                         so its mean square is summed over the ranks: an all-reduce of one float
                         per token.
  sparse_attention_gated with replicated KV heads (tp_size > num_key_value_heads): a KV group's
                         query heads are spread over the kv_group sub-group, and its stage-1
                         score is a sum over all of them (spec 3.4), so each rank's fp32 partial
                         sum is all-reduced over kv_group before the bf16 rounding and the top-k
                         (the torch backend's score_reduce hook). Without kv_group nothing changes.

Everything else (sparse attention on the local KV heads, Lightning GLA on the local heads with
their global decay slopes, the replicated embeddings and lm_head) is the inner backend's op on
local shapes, reached through __getattr__. Inside a CUDA graph capture the all-reduces are
captured like any op (NCCL supports capture); that GPU path is unmeasured.
"""

from __future__ import annotations

import torch

from salaserve.parallel.group import TPGroup


class TensorParallelOps:
    def __init__(self, inner, group: TPGroup, kv_group: TPGroup | None = None):
        """kv_group: this rank's sub-group of the ranks that replicate its KV head (group.split_group),
        or None when every rank holds KV heads of its own."""
        self.inner = inner
        self.group = group
        self.kv_group = kv_group
        self.name = inner.name

    def __getattr__(self, name):  # every op that needs no communication
        return getattr(self.inner, name)

    def residual_norm_linear(self, h, x, w_out, scale, norm_w, eps, w_in, silu: bool = False,
                             silu_out: bool = False):
        """As the inner backend's, with this rank's partial linear(x, w_out) summed over the ranks
        before it joins the residual."""
        ops = self.inner
        u = ops.silu_mul_linear(x, w_out) if silu else ops.linear(x, w_out)
        u = self.group.all_reduce(u)
        if norm_w is None:
            return h + u * scale, None
        if silu_out:
            return ops.add_rms_norm_silu_linear(h, u, scale, norm_w, eps, w_in)
        return ops.add_rms_norm_linear(h, u, scale, norm_w, eps, w_in)

    def sparse_attention_gated(self, q, kv, comp, layer, batch, cfg, gate):
        """As the inner backend's, with the stage-1 partial scores summed over kv_group."""
        reduce = None if self.kv_group is None else self.kv_group.all_reduce
        return self.inner.sparse_attention_gated(q, kv, comp, layer, batch, cfg, gate, score_reduce=reduce)

    def lightning_output(self, o, o_norm, z, eps, dtype):
        """bf16(o) -> RMSNorm over all ranks' heads (this rank's slice of o_norm) -> times
        sigmoid(z). The same rounding points as the reference's rms_norm."""
        o = o.to(dtype).flatten(1)
        sq = o.float().pow(2).sum(-1, keepdim=True)
        var = self.group.all_reduce(sq) / (o.shape[-1] * self.group.size)
        return (o.float() * torch.rsqrt(var + eps)).to(o.dtype) * o_norm * torch.sigmoid(z)
