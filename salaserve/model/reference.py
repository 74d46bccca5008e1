"""The executable spec: a plain PyTorch MiniCPM-SALA forward, one sequence at a time.

Readable before fast. Every fast path in salaserve is tested against this file; it is never
"optimized". Section numbers refer to `shared/reference/minicpm_sala_spec.md`.

    model = ReferenceModel.from_pretrained(dir, dtype=torch.float32, device="cpu")
    state = model.new_state()
    logits = model.forward(input_ids, state)   # appends input_ids to the sequence, [T, vocab] fp32

Numerics follow HF: the residual stream and projections in the model dtype (bf16 or fp32),
RMSNorm statistics in fp32, attention softmax in fp32, the Lightning recurrence and its state in
fp32. In fp32 mode the bf16 roundings of HF become no-ops, except the stage-1 block scores, which
are always rounded to bf16 as the InfLLM-v2 kernel stores them (they decide which blocks are read).

Multi-token calls on top of a cache (chunked prefill) use absolute positions, cache_len = L - T
(spec 3.6), which the HF reference does not support (Q5).

Stage-1 visibility (which compressed keys a query's block scores see, `visible_count`) follows the
official InfLLM-v2 kernels (docs/infllmv2-semantics.md, 1(d) and D1): prompt tokens see what the
official single-shot prefill of the whole prompt shows them, output tokens (decode, speculative
verify, the recomputed output of a preempted request) see every complete entry, as official decode
does. A sequence's prompt length is `ReferenceState.prompt_len`; by default its first call is the
whole prompt, as HF's prefill call is. So a prompt fed in chunks (with new_state(prompt_len=L))
gives the single-shot result: the rule depends on the prompt's length, not on where chunks end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from salaserve.config import ModelConfig, SparseConfig

# ---------------------------------------------------------------------------------------------
# Small ops (spec section 1)
# ---------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF rms_layernorm: fp32 statistics, normalised value rounded to x.dtype, then times weight."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.t()


def mlp(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = linear(x, w[prefix + "mlp.gate_proj.weight"])
    up = linear(x, w[prefix + "mlp.up_proj.weight"])
    return linear(F.silu(gate) * up, w[prefix + "mlp.down_proj.weight"])


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin for NeoX (rotate-half) RoPE over all head_dim dims (spec 4.2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)  # [T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, d]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; rotation in fp32, result cast back to x.dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Lightning attention: simple gated linear attention (spec section 4)
# ---------------------------------------------------------------------------------------------


def gla_recurrent(q, k, v, log_decay, state, scale):
    """Token-by-token form (spec 4.4). q, k, v [T, H, d] fp32; log_decay [H] (= -slope);
    state [H, dk, dv] fp32. Returns (o [T, H, dv] fp32, new state)."""
    gamma = log_decay.exp()[:, None, None]
    out = []
    for t in range(q.shape[0]):
        state = gamma * state + k[t, :, :, None] * v[t, :, None, :]  # S = g*S + k^T v
        out.append(scale * torch.einsum("hk,hkv->hv", q[t], state))  # o = s * q S
    return torch.stack(out), state


def gla_chunked(q, k, v, log_decay, state, scale, chunk_size: int = 64):
    """Chunked-parallel form (spec 4.5), the same function as gla_recurrent. A partial last chunk
    uses its real length in the decay powers. Returns (o, new state)."""
    T, H, _ = q.shape
    out = []
    g = log_decay.float()  # [H]
    for start in range(0, T, chunk_size):
        qc, kc, vc = (x[start:start + chunk_size].transpose(0, 1) for x in (q, k, v))  # [H, c, d]
        c = qc.shape[1]
        idx = torch.arange(c, device=q.device, dtype=torch.float32)
        rel = idx[:, None] - idx[None, :]  # tau - s
        causal = rel >= 0
        decay = torch.where(causal, torch.exp(g[:, None, None] * rel.clamp(min=0)), 0.0)  # [H, c, c]
        intra = ((qc @ kc.transpose(1, 2)) * decay) @ vc  # sum_s g^(tau-s) (q_tau.k_s) v_s
        inter = torch.exp(g[:, None, None] * (idx[None, :, None] + 1)) * (qc @ state)  # g^tau q S0
        out.append((scale * (intra + inter)).transpose(0, 1))
        k_decay = torch.exp(g[:, None, None] * (c - 1 - idx)[None, :, None])  # g^(c-s)
        state = torch.exp(g * c)[:, None, None] * state + (kc * k_decay).transpose(1, 2) @ vc
    return torch.cat(out), state


# ---------------------------------------------------------------------------------------------
# InfLLM-v2 sparse attention (spec section 3)
# ---------------------------------------------------------------------------------------------


def compress_keys(keys: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Mean-pooled keys over complete windows (spec 3.3). keys [L, Hkv, d] -> [n, Hkv, d] with
    n = max(0, (L - kernel) // stride + 1); mean accumulated in fp32, stored in keys.dtype."""
    L = keys.shape[0]
    if L < kernel:
        return keys.new_zeros(0, *keys.shape[1:])
    windows = keys.float().unfold(0, kernel, stride)  # [n, Hkv, d, kernel]
    return windows.mean(-1).to(keys.dtype)


def window_means(keys: torch.Tensor, first: int, last: int, kernel: int, stride: int, dtype) -> torch.Tensor:
    """Compressed entries first..last-1 (entry j: the fp32 mean of keys[stride*j : stride*j + kernel]),
    as dtype: [last - first, Hkv, d]. The one formula the caches' incremental updates use, so an entry
    computed at decode, at verify or at a tree's commit is the same bits."""
    rows = [keys[j * stride: j * stride + kernel].float().mean(0).to(dtype) for j in range(first, last)]
    return torch.stack(rows) if rows else keys.new_zeros(0, *keys.shape[1:]).to(dtype)


def visible_count(positions: torch.Tensor, kernel: int, stride: int, total: int,
                  prompt_len: int = 0) -> torch.Tensor:
    """Compressed entries (window [stride*j, stride*j + kernel)) that stage 1 shows the query at
    each position, of the `total` that exist.

    Natural causal rule: the entries whose whole window lies in [0, p]. That is what official decode
    shows (causal=False: every existing entry, all of them complete), and it applies to every
    token at or past prompt_len.

    Prompt tokens (p < prompt_len) see what the official single-shot prefill of the prompt (one
    stage-1 call with T = prompt_len queries) shows them: one entry fewer for every prompt token
    when prompt_len = stride - 1 (mod stride), i.e. L = 15 (mod 16) for C1 and 63 (mod 64) for C2.
    That is `kernel_visible_count` with T = prompt_len (tests check it for every small L); written
    per position so that a prompt computed in chunks, or recomputed after a preemption, gets the
    single-shot values.
    """
    n = torch.div(positions - kernel + 1, stride, rounding_mode="floor") + 1
    lag = int(prompt_len % stride == stride - 1) * (positions < prompt_len).long()
    return (n - lag).clamp(min=0, max=total)


def kernel_visible_count(n_queries: int, kernel: int, stride: int, total: int, device) -> torch.Tensor:
    """The official kernel's stage-1 mask for one multi-token call (causal=True), transcribed:
    [KRN] csrc/flash_attn/src/mask.h:226-319 (apply_mask_stage1), bottom-right aligned on the call's
    own query indices t with C integer division (truncation toward zero). `total` is the entries of
    the whole sequence. Used by tests: salaserve's prompt rule (`visible_count` with prompt_len) is
    this with n_queries = prompt_len; for other calls (chunks) it can show entries whose window
    reaches past the query, which salaserve never does (docs/infllmv2-semantics.md 1(h))."""
    t = torch.arange(n_queries, device=device)
    offset = total - int((n_queries - (stride - 1)) / stride)  # C: trunc((T - S + 1) / S)
    n = torch.div(t + 1, stride, rounding_mode="floor") - 1 + offset
    return n.clamp(min=0, max=total)


def block_scores(scores: torch.Tensor, query_blocks: torch.Tensor, num_blocks: int,
                 sc: SparseConfig) -> torch.Tensor:
    """Pool C1 scores to blocks and force init/local blocks to +inf, future blocks to -inf
    (spec 3.4 step 2). Shapes as in `select_blocks`; returns [G, T, num_blocks] fp32."""
    G, T, n1 = scores.shape
    per_block, pad, width = sc.c1_per_block, sc.pool_padding, sc.pool_kernel
    # C1 entries overlapping block b: [per_block*b - pad, per_block*b - pad + width).
    padded = F.pad(scores.float(), (pad, num_blocks * per_block + width - n1 - pad), value=float("-inf"))
    windows = padded.unfold(-1, width, per_block)[:, :, :num_blocks]  # [G, T, nb, width]
    pooled = windows.amax(-1)

    b = torch.arange(num_blocks, device=scores.device)
    qb = query_blocks[:, None]
    forced = (b[None, :] < sc.init_blocks) | ((b[None, :] >= qb - sc.local_blocks) & (b[None, :] <= qb))
    pooled = torch.where(forced[None], float("inf"), pooled)
    return torch.where((b[None, :] > qb)[None], float("-inf"), pooled)


def select_blocks(scores: torch.Tensor, query_blocks: torch.Tensor, num_blocks: int,
                  sc: SparseConfig) -> torch.Tensor:
    """Pool C1 scores to blocks, force init/local blocks, drop future blocks, take top-k (spec 3.4).

    scores: [G, T, n1] block-relevance per C1 entry (already bf16-rounded, 0 where not visible).
    query_blocks: [T] block index of each query's absolute position.
    Returns a bool mask [G, T, num_blocks] of selected blocks.

    Future blocks get -inf rather than the kernel's 0 so that a past block whose score underflows
    to 0 is never displaced by a future one (spec Q4); the selected causal set is otherwise the
    kernel's. Ties are broken toward the lower block index (a stable sort), so that the engine's
    kernels can reproduce the choice exactly (torch.topk's CUDA tie order is unspecified, Q4).
    """
    return select_from_block_scores(block_scores(scores, query_blocks, num_blocks, sc), query_blocks, sc)


def select_from_block_scores(bscores: torch.Tensor, query_blocks: torch.Tensor, sc: SparseConfig) -> torch.Tensor:
    """Top-k of `block_scores` output [G, T, nb] with ties toward the lower block index; causal only."""
    G, T, num_blocks = bscores.shape
    k = min(sc.topk_eff, num_blocks)
    order = torch.sort(bscores, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros(G, T, num_blocks, dtype=torch.bool, device=bscores.device)
    chosen.scatter_(-1, order, True)
    b = torch.arange(num_blocks, device=bscores.device)
    return chosen & (b[None, :] <= query_blocks[:, None])[None]


def stage1_scores(q: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, vis1: torch.Tensor,
                  vis2: torch.Tensor, group: int, scale: float, reduce=None) -> torch.Tensor:
    """Block-relevance of each C1 entry per (KV group, query) (spec 3.4 step 1).

    q [T, Hq, d]; c1 [n1, Hkv, d]; c2 [n2, Hkv, d]; vis1/vis2 [T] visible entry counts.
    Softmax-like weights exp(a - lse) with the log-sum-exp taken over the *coarse* keys C2, summed
    over the `group` query heads of each KV head, rounded to bf16. Returns [Hkv, T, n1] fp32.
    reduce: None, or (tensor parallelism with a KV head's query heads on several ranks) a function
    that sums the fp32 partial sums [Hkv, T, n1] of this rank's heads over those ranks, in place,
    before the bf16 rounding, as the spec's fp32 sum over the whole group.
    """
    qf = q.float()
    hkv = c1.shape[1]
    qg = qf.view(qf.shape[0], hkv, group, qf.shape[-1])  # head h -> KV head h // group
    a = scale * torch.einsum("tgnd,jgd->gtnj", qg, c1.float())  # [G, T, group, n1]
    b = scale * torch.einsum("tgnd,igd->gtni", qg, c2.float())  # [G, T, group, n2]
    i2 = torch.arange(c2.shape[0], device=q.device)
    b = b.masked_fill(~(i2[None, :] < vis2[:, None])[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(b, dim=-1, keepdim=True)  # -inf when no C2 entry is visible
    p = torch.exp(a - lse)
    j1 = torch.arange(c1.shape[0], device=q.device)
    p = p.masked_fill(~(j1[None, :] < vis1[:, None])[None, :, None, :], 0.0)
    # A row that sees no C2 entry scores 0 (the kernel returns before writing its zero-filled
    # output: fwd_kernel.h:1271, flash_api.cpp:941). Otherwise an fp32 overflow (a - lse > ~88.7)
    # stays +inf: the wrapper maps only NaN to 0 (infllmv2_sparse_attention.py:589), so such an
    # entry's block scores +inf and is chosen like a forced one (ties: lower block first).
    p = torch.where((vis2 > 0)[None, :, None, None], p, 0.0)
    p = torch.where(p.isnan(), 0.0, p)
    s = p.sum(2)
    if reduce is not None:
        s = reduce(s)
    return s.to(torch.bfloat16).float()


def attention(q, keys, values, allowed, scale):
    """Softmax attention in fp32. q [T, Hq, d]; keys/values [L, Hkv, d];
    allowed [Hkv or 1, T, L] bool. Returns [T, Hq, d] in q.dtype."""
    T, Hq, d = q.shape
    hkv = keys.shape[1]
    group = Hq // hkv
    qg = q.float().view(T, hkv, group, d)
    s = scale * torch.einsum("tgnd,lgd->gntl", qg, keys.float())  # [G, group, T, L]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    o = torch.einsum("gntl,lgd->tgnd", torch.softmax(s, dim=-1), values.float())
    return o.reshape(T, Hq, d).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


@dataclass
class ReferenceState:
    """Everything one sequence carries between calls."""

    length: int = 0
    # tokens at positions below it are prompt tokens (stage-1 rule, `visible_count`); None: the
    # first forward call is the whole prompt
    prompt_len: int | None = None
    keys: dict = field(default_factory=dict)  # sparse layer -> [L, Hkv, d]
    values: dict = field(default_factory=dict)
    gla: dict = field(default_factory=dict)  # lightning layer -> [H, dk, dv] fp32


class ReferenceModel:
    def __init__(self, config: ModelConfig, weights: dict, dtype=torch.float32, device="cpu",
                 query_chunk: int = 1024):
        self.config = config
        self.w = weights
        self.dtype = dtype
        self.device = torch.device(device)
        self.query_chunk = query_chunk  # bounds attention memory at long prompts, not the math
        self.log_decay = -torch.tensor(config.lightning_slopes(), dtype=torch.float32, device=self.device)

    @classmethod
    def from_pretrained(cls, model_dir, dtype=torch.float32, device="cpu", load_format: str = "auto",
                        seed: int = 0, **kwargs) -> "ReferenceModel":
        from salaserve.model.loader import load_state_dict

        config = ModelConfig.from_pretrained(model_dir)
        weights = load_state_dict(model_dir, config, dtype=dtype, device=device,
                                  load_format=load_format, seed=seed)
        return cls(config, weights, dtype=dtype, device=device, **kwargs)

    def new_state(self, prompt_len: int | None = None) -> ReferenceState:
        """A new sequence. prompt_len: its prompt's length, needed when the prompt is fed in more
        than one call (chunks); None: the first forward call is the whole prompt."""
        return ReferenceState(prompt_len=prompt_len)

    @torch.no_grad()
    def forward(self, input_ids, state: ReferenceState, aux_layers=None):
        """Append input_ids to the sequence in `state`; return fp32 logits [T, vocab]. With
        aux_layers: (logits, aux [T, len(aux_layers)*hidden]), the residual stream after each named
        layer, concatenated in order (EAGLE-3's target features)."""
        return self.forward_with_grad(input_ids, state, aux_layers)

    def forward_with_grad(self, input_ids, state: ReferenceState, aux_layers=None):
        """Same as forward, with autograd enabled (used by the small-model trainer)."""
        cfg, w = self.config, self.w
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(-1)
        positions = state.length + torch.arange(ids.numel(), device=self.device)
        if state.prompt_len is None:  # the first call is the prompt (HF's prefill call)
            state.prompt_len = state.length + ids.numel()
        h = (w["model.embed_tokens.weight"][ids] * cfg.scale_emb).to(self.dtype)
        r = cfg.residual_scale
        captured = {}
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            a = rms_norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            if cfg.is_sparse_layer(layer):
                u = self._sparse_mixer(layer, a, positions, state)
            else:
                u = self._lightning_mixer(layer, a, positions, state)
            h = h + u * r
            b = rms_norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            h = h + mlp(b, w, p) * r
            if aux_layers and layer in aux_layers:
                captured[layer] = h
        state.length += ids.numel()
        z = rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)
        logits = linear(z / cfg.logit_divisor, w["lm_head.weight"]).float()
        if aux_layers:
            return logits, torch.cat([captured[i] for i in aux_layers], dim=-1)
        return logits

    # ---- sparse layers (spec 3) ---------------------------------------------------------------
    def _sparse_mixer(self, layer, a, positions, state):
        cfg, w = self.config, self.w
        p = f"model.layers.{layer}.self_attn."
        T, d = a.shape[0], cfg.head_dim
        q = linear(a, w[p + "q_proj.weight"]).view(T, cfg.num_attention_heads, d)
        k = linear(a, w[p + "k_proj.weight"]).view(T, cfg.num_key_value_heads, d)
        v = linear(a, w[p + "v_proj.weight"]).view(T, cfg.num_key_value_heads, d)
        keys = k if layer not in state.keys else torch.cat([state.keys[layer], k])
        values = v if layer not in state.values else torch.cat([state.values[layer], v])
        state.keys[layer], state.values[layer] = keys, values

        L = keys.shape[0]
        if L < cfg.sparse.dense_len:  # dense while the total length is below dense_len (3.2)
            o = self._dense_attention(q, keys, values, positions)
        else:
            prompt_len = state.length + T if state.prompt_len is None else state.prompt_len
            o = self._infllm_v2_attention(q, keys, values, positions, prompt_len)
        o = o.reshape(T, -1) * torch.sigmoid(linear(a, w[p + "o_gate.weight"]))
        return linear(o, w[p + "o_proj.weight"])

    def _dense_attention(self, q, keys, values, positions):
        scale = self.config.head_dim ** -0.5
        key_pos = torch.arange(keys.shape[0], device=self.device)
        outs = []
        for s in range(0, q.shape[0], self.query_chunk):
            pos = positions[s:s + self.query_chunk]
            allowed = (key_pos[None, :] <= pos[:, None])[None]
            outs.append(attention(q[s:s + self.query_chunk], keys, values, allowed, scale))
        return torch.cat(outs)

    def _infllm_v2_attention(self, q, keys, values, positions, prompt_len: int):
        cfg, sc = self.config, self.config.sparse
        scale = cfg.head_dim ** -0.5
        L, T = keys.shape[0], q.shape[0]
        c1 = compress_keys(keys, sc.kernel_size, sc.kernel_stride)
        c2 = compress_keys(keys, sc.c2_kernel_size, sc.c2_kernel_stride)
        # prompt tokens: the official single-shot prefill's mask; later tokens: every complete entry
        vis1_all = visible_count(positions, sc.kernel_size, sc.kernel_stride, c1.shape[0], prompt_len)
        vis2_all = visible_count(positions, sc.c2_kernel_size, sc.c2_kernel_stride, c2.shape[0], prompt_len)
        num_blocks = -(-L // sc.block_size)
        key_pos = torch.arange(L, device=self.device)
        outs = []
        for s in range(0, T, self.query_chunk):
            sl = slice(s, s + self.query_chunk)
            pos = positions[sl]
            scores = stage1_scores(q[sl], c1, c2, vis1_all[sl], vis2_all[sl], cfg.gqa_group_size, scale)
            blocks = select_blocks(scores, pos // sc.block_size, num_blocks, sc)  # [G, t, nb]
            # Stage 2: attend to the tokens of the selected blocks, causally (spec 3.5).
            allowed = blocks.repeat_interleave(sc.block_size, dim=-1)[..., :L]
            allowed = allowed & (key_pos[None, :] <= pos[:, None])[None]
            outs.append(attention(q[sl], keys, values, allowed, scale))
        return torch.cat(outs)

    # ---- lightning layers (spec 4) ------------------------------------------------------------
    def _lightning_mixer(self, layer, a, positions, state):
        cfg, w = self.config, self.w
        p = f"model.layers.{layer}.self_attn."
        T, H, d = a.shape[0], cfg.lightning_nh, cfg.lightning_head_dim
        q = linear(a, w[p + "q_proj.weight"]).view(T, H, d)
        k = linear(a, w[p + "k_proj.weight"]).view(T, H, d)
        v = linear(a, w[p + "v_proj.weight"]).view(T, H, d)
        q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps)  # per head, before RoPE
        k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
        cos, sin = rope_cos_sin(positions, d, cfg.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        gla_state = state.gla.get(layer)
        if gla_state is None:
            gla_state = torch.zeros(H, d, d, dtype=torch.float32, device=self.device)
        form = gla_recurrent if T == 1 else gla_chunked
        o, state.gla[layer] = form(q.float(), k.float(), v.float(), self.log_decay, gla_state,
                                   cfg.lightning_attn_scale)
        o = o.to(self.dtype).reshape(T, H * d)
        o = rms_norm(o, w[p + "o_norm.weight"], cfg.rms_norm_eps)  # one group over H*d (4.1)
        o = o * torch.sigmoid(linear(a, w[p + "z_proj.weight"]))
        return linear(o, w[p + "o_proj.weight"])
