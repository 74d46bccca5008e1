"""The `torch` kernel backend: plain PyTorch implementations of every op the serving model calls.

Used on CPU and as the ground truth for the `triton` backend. Sequences are handled one at a time
where that keeps the code obvious; the spec's pure functions (stage-1 scores, block selection,
softmax attention, the GLA forms) are shared with the reference model, while everything that
touches the paged caches (writes, gathers, incremental compression, state slots) is this file's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from salaserve.cache.compressed import CompressedKeyPool, num_entries
from salaserve.cache.pages import KVPool
from salaserve.cache.state import StatePool
from salaserve.config import ModelConfig
from salaserve.core.batch import ForwardBatch
from salaserve.kernels import tree_verify
from salaserve.model import reference as spec
from salaserve.quant.fuse import SplitLinear


class TorchBackend:
    name = "torch"
    # verifies draft trees (kernels/tree_verify.py); a backend without it gets chains only
    supports_tree_verify = True

    # ---- elementwise / norms -----------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        return spec.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual, update, scale, weight, eps):
        """residual + update*scale (two roundings, as HF), then its RMSNorm."""
        h = residual + update * scale
        return h, spec.rms_norm(h, weight, eps)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def linear(self, x, weight):
        if isinstance(weight, torch.Tensor):  # bf16 / fp32 weights: the plain matmul
            return x @ weight.t()
        if isinstance(weight, SplitLinear):  # fused parts that could not be concatenated
            return torch.cat([self.linear(x, p) for p in weight.parts], dim=-1)
        from salaserve.kernels.quant_gemm import quant_linear  # imports triton: only when quantized

        return quant_linear(x, weight)

    # ---- the junctions between layers ---------------------------------------------------------
    # The model calls these instead of the separate ops, so a backend can fuse a norm into the
    # next linear's input and a residual add into the previous linear's output (decode GEMVs).
    def norm_linear(self, x, norm_w, eps, w):
        """linear(rms_norm(x, norm_w), w)."""
        return self.linear(self.rms_norm(x, norm_w, eps), w)

    def residual_norm_linear(self, h, x, w_out, scale, norm_w, eps, w_in, silu: bool = False,
                             silu_out: bool = False):
        """h' = h + linear(x, w_out) * scale (x through silu_mul first if `silu`); returns
        (h', linear(rms_norm(h', norm_w), w_in)), or (h', None) when norm_w is None. silu_out: the
        second value is silu_mul of that linear (w_in a [gate | up] weight)."""
        u = self.silu_mul_linear(x, w_out) if silu else self.linear(x, w_out)
        if norm_w is None:
            return h + u * scale, None
        if silu_out:
            return self.add_rms_norm_silu_linear(h, u, scale, norm_w, eps, w_in)
        return self.add_rms_norm_linear(h, u, scale, norm_w, eps, w_in)

    def add_rms_norm_silu_linear(self, h, u, scale, norm_w, eps, w):
        """(h + u * scale, silu_mul(linear(its RMSNorm, w))) for a [gate | up] weight w: the norm side
        of the silu_out junction (a backend may quantize the normed rows as it computes them)."""
        h, normed = self.add_rms_norm(h, u, scale, norm_w, eps)
        return h, self.silu_linear(normed, w)

    def add_rms_norm_linear(self, h, u, scale, norm_w, eps, w):
        """(h + u * scale, linear(its RMSNorm, w)): the norm side of a junction (a backend may
        quantize the normed rows as it computes them)."""
        h, normed = self.add_rms_norm(h, u, scale, norm_w, eps)
        return h, self.linear(normed, w)

    def silu_linear(self, x, w):
        """silu_mul(linear(x, w)) for a [gate | up] weight w: the gate_up side of the silu_out
        junction (a backend may write the activation straight from the linear)."""
        return self.silu_mul(self.linear(x, w))

    def silu_mul_linear(self, gate_up, w):
        """linear(silu_mul(gate_up), w): the down side of the MLP when silu_mul comes before it
        (a backend may quantize the activation as it computes it)."""
        return self.linear(self.silu_mul(gate_up), w)

    def silu_after_gate_up(self, rows: int) -> bool:
        """Where a step of `rows` tokens applies the MLP's silu_mul: True, in the gate_up junction
        (residual_norm_linear(..., silu_out=True)); False, before down (silu=True). The same
        values either way; it only says which side a backend fuses it into."""
        return False

    def sigmoid_mul(self, x, gate):
        return x * torch.sigmoid(gate)

    # ---- lightning layers --------------------------------------------------------------------
    def lightning_qk_norm_rope(self, q, k, q_norm, k_norm, positions, eps, theta):
        """q, k [N, H, d]: per-head RMSNorm, then NeoX RoPE at absolute positions."""
        q = spec.rms_norm(q, q_norm, eps)
        k = spec.rms_norm(k, k_norm, eps)
        cos, sin = spec.rope_cos_sin(positions, q.shape[-1], theta)
        return spec.apply_rope(q, cos, sin), spec.apply_rope(k, cos, sin)

    def lightning_attention(self, q, k, v, q_norm, k_norm, batch: ForwardBatch, states: StatePool, layer: int,
                            log_decay, scale, eps, theta):
        """q/k RMSNorm + RoPE, then simple GLA from each sequence's state slot. o [N, H, d] fp32 (a
        backend may return it in a narrower float dtype that lightning_output's first rounding absorbs)."""
        q, k = self.lightning_qk_norm_rope(q, k, q_norm, k_norm, batch.positions, eps, theta)
        return self.gla(q, k, v, batch, states, layer, log_decay, scale)

    def gla(self, q, k, v, batch: ForwardBatch, states: StatePool, layer: int, log_decay, scale):
        """Simple GLA over each sequence's tokens, starting from and writing back its state slot.
        q, k, v [N, H, d] (any float dtype); returns o [N, H, d] fp32."""
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        start = 0
        for i, n in enumerate(batch.q_lens_host):
            slot = int(batch.state_slots[i])
            s = states.state[slot, layer]
            sl = slice(start, start + n)
            kf, vf = k[sl].float(), v[sl].float()
            if batch.trees and batch.trees[i] is not None:  # each row along its path, not committed
                o = tree_verify.tree_gla(q[sl].float(), kf, vf, batch.trees[i], log_decay, s.float(), scale)
                batch.spec_kv[(layer, i)] = (kf, vf)
            elif batch.verify_host and batch.verify_host[i]:
                # token by token, exactly as plain decoding would; the state is not committed
                o, _ = spec.gla_recurrent(q[sl].float(), kf, vf, log_decay, s.float(), scale)
                batch.spec_kv[(layer, i)] = (kf, vf)
            else:
                form = spec.gla_recurrent if n == 1 else spec.gla_chunked
                o, new_state = form(q[sl].float(), kf, vf, log_decay, s.float(), scale)
                states.state[slot, layer] = new_state.to(states.state.dtype)
            out[sl] = o
            start += n
        return out

    def gla_commit(self, states: StatePool, layer: int, slot: int, k, v, log_decay, n: int):
        """Advance a verified sequence's state by its first n tokens (accepted prefix), replaying
        the recurrence from the live state with the k/v kept from the verify step."""
        s = states.state[slot, layer].float()
        gamma = log_decay.exp()[:, None, None]
        for t in range(n):
            s = gamma * s + k[t, :, :, None] * v[t, :, None, :]
        states.state[slot, layer] = s.to(states.state.dtype)

    def commit_verified(self, states: StatePool, batch: ForwardBatch, commits, log_decay) -> None:
        """After a verify step: every Lightning layer of each (seq index, slot, n) in commits
        advances by the sequence's first n tokens, from the k/v the step kept; n may be a list of
        verify rows instead (a tree's accepted path), replayed in that order."""
        for layer in range(states.state.shape[1]):
            for i, slot, n in commits:
                k, v = batch.spec_kv.pop((layer, i))
                if not isinstance(n, int):
                    k, v, n = k[n], v[n], len(n)
                self.gla_commit(states, layer, slot, k, v, log_decay, n)

    def commit_tree_kv(self, kv: KVPool, comp: CompressedKeyPool, batch: ForwardBatch, commits) -> None:
        """After a tree verify: the sparse layers' cache gets the accepted path's K/V and compressed
        entries. commits: (seq index, slot, accepted verify rows)."""
        tree_verify.commit_tree_kv(kv, comp, batch, commits, self._compress_range)

    def lightning_output(self, o, o_norm, z, eps, dtype):
        """bf16(o) -> RMSNorm over the full H*d vector -> times sigmoid(z)."""
        o = o.to(dtype).flatten(1)
        return spec.rms_norm(o, o_norm, eps) * torch.sigmoid(z)

    # ---- sparse layers -----------------------------------------------------------------------
    def store_kv(self, kv: KVPool, layer: int, k, v, batch: ForwardBatch):
        if not batch.trees:
            kv.write(layer, batch.slot_mapping, k, v)
            return
        # tree verify: candidates share positions, so their K/V wait in spec_kv for the commit
        for i, (start, end) in enumerate(tree_verify.row_ranges(batch)):
            if batch.trees[i] is not None:
                batch.spec_kv[("kv", layer, i)] = (k[start:end], v[start:end])
        rows = tree_verify.cache_write_rows(batch)
        kv.write(layer, batch.slot_mapping[rows], k[rows], v[rows])

    def update_compressed(self, kv: KVPool, comp: CompressedKeyPool, layer: int, batch: ForwardBatch):
        """Write every C1/C2 entry born during this step (after the step's keys are stored); a
        tree verify's only up to its root (its path's come with the commit)."""
        for i in range(batch.num_seqs):
            old, new = batch.cache_lens_host[i], batch.seq_lens_host[i]
            if batch.trees and batch.trees[i] is not None:
                new = old + 1
            self._compress_range(kv, comp, layer, batch.page_table[i], old, new)

    def _compress_range(self, kv: KVPool, comp: CompressedKeyPool, layer: int, pages, old: int, new: int):
        """The C1/C2 entries of one sequence completed between length old and new, from its cache."""
        sc = comp.sc
        levels = ((comp.c1, sc.kernel_size, sc.kernel_stride, comp.c1_per_page),
                  (comp.c2, sc.c2_kernel_size, sc.c2_kernel_stride, comp.c2_per_page))
        for pool, kernel, stride, per_page in levels:
            first, last = num_entries(old, kernel, stride), num_entries(new, kernel, stride)
            if last <= first:
                continue
            keys, _ = kv.gather(layer, pages[: -(-new // kv.block_size)], new)
            entries = spec.window_means(keys, first, last, kernel, stride, pool.dtype)
            for j, entry in zip(range(first, last), entries):
                pool[layer, pages[j // per_page], j % per_page] = entry

    def sparse_attention_gated(self, q, kv: KVPool, comp: CompressedKeyPool, layer: int, batch: ForwardBatch,
                               cfg: ModelConfig, gate, score_reduce=None):
        """sparse_attention times the output gate: sigmoid_mul(o as [N, Hq*d], gate [N, Hq*d]), the
        sparse mixer's output (a backend may apply the gate in the attention's last kernel)."""
        o = self.sparse_attention(q, kv, comp, layer, batch, cfg, score_reduce=score_reduce)
        return self.sigmoid_mul(o.reshape(q.shape[0], -1), gate)

    def sparse_attention(self, q, kv: KVPool, comp: CompressedKeyPool, layer: int, batch: ForwardBatch,
                         cfg: ModelConfig, score_reduce=None):
        """Per sequence: dense causal attention while its total length < dense_len, else InfLLM-v2
        (stage-1 scores with the C2 log-sum-exp over the entries reference.visible_count shows each
        token given its sequence's prompt length, pooling, forced + top-k blocks, block-sparse
        attention). q [N, Hq, d]; returns [N, Hq, d] in q.dtype. score_reduce: reference.stage1_scores'
        reduce (a KV group's query heads spread over tensor-parallel ranks; called once per sparse
        sequence, or tree row, in batch order, so every rank of the sub-group joins the same calls)."""
        sc = cfg.sparse
        scale = cfg.head_dim ** -0.5
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(batch.q_lens_host):
            if batch.trees and batch.trees[i] is not None:  # each row as a decode of its path
                out[start:start + n] = tree_verify.tree_attention(q[start:start + n], kv, comp, layer, batch, i, cfg,
                                                                       score_reduce)
                start += n
                continue
            L = batch.seq_lens_host[i]
            pages = batch.page_table[i, : -(-L // kv.block_size)]
            keys, values = kv.gather(layer, pages, L)
            qi = q[start:start + n]
            pos = batch.positions[start:start + n]
            key_pos = torch.arange(L, device=q.device)
            causal = key_pos[None, :] <= pos[:, None]  # [n, L]
            verify = bool(batch.verify_host and batch.verify_host[i])
            if verify:  # plain decoding at position p is dense iff p + 1 < dense_len
                dense_rows = pos + 1 < sc.dense_len
            if not batch.is_sparse_host[i] or (verify and bool(dense_rows.all())):
                out[start:start + n] = spec.attention(qi, keys, values, causal[None], scale)
            else:
                c1, c2 = comp.gather(layer, pages, L)
                plen = batch.prompt_lens_host[i] if batch.prompt_lens_host else 0  # prompt tokens: prompt rule
                vis1 = spec.visible_count(pos, sc.kernel_size, sc.kernel_stride, c1.shape[0], plen)
                vis2 = spec.visible_count(pos, sc.c2_kernel_size, sc.c2_kernel_stride, c2.shape[0], plen)
                scores = spec.stage1_scores(qi, c1, c2, vis1, vis2, cfg.gqa_group_size, scale, score_reduce)
                blocks = spec.select_blocks(scores, pos // sc.block_size, pages.numel(), sc)
                allowed = blocks.repeat_interleave(sc.block_size, dim=-1)[..., :L] & causal[None]
                if verify:
                    allowed = torch.where(dense_rows[None, :, None], causal[None], allowed)
                out[start:start + n] = spec.attention(qi, keys, values, allowed, scale)
            start += n
        return out
