"""The `triton` kernel backend: fused GPU kernels behind TorchBackend's interface.

Decode batches (CUDA-graph mode included) only touch device tensors; eager prefill and verify
steps may use the batch's host mirrors. Ops without a Triton version yet fall through to the
torch implementation (correct, slow): speculative verify.

Note for comparisons: with random full-size weights, 32 bf16 layers amplify any rounding
difference (another split count, another GEMM tile for a padded M) to ~2% of the logits, so
only identical kernel choices give identical results.
"""

from __future__ import annotations

import torch

from salaserve.kernels import attention as attn
from salaserve.kernels import gemv as gemv_ops
from salaserve.kernels import sparse as sparse_ops
from salaserve.kernels.fused import TritonFusedOps
from salaserve.kernels.lightning import TritonLightningOps
from salaserve.kernels.torch_ops import TorchBackend


def _has_verify(batch) -> bool:
    return bool(batch.verify_host) and any(batch.verify_host)


class TritonBackend(TritonFusedOps, TritonLightningOps, TorchBackend):
    name = "triton"

    # ---- linear layers -----------------------------------------------------------------------
    def prepare(self, cfg, device) -> None:
        """Start-up: time cuBLAS against the split-K GEMV for the model's shapes at decode batch
        sizes, so `linear` takes the faster one (a few seconds, before graph capture)."""
        gemv_ops.calibrate([(n, k) for _, n, k, _ in gemv_ops.model_linear_shapes(cfg)], device)

    def linear(self, x, weight):
        if isinstance(weight, torch.Tensor) and x.dim() == 2 and x.shape[0] <= 16:
            return gemv_ops.linear(x, weight)
        return TorchBackend.linear(self, x, weight)

    # ---- lightning layers --------------------------------------------------------------------
    def lightning_attention(self, q, k, v, q_norm, k_norm, batch, states, layer, log_decay, scale, eps, theta):
        if batch.is_decode and not _has_verify(batch):
            return self.lightning_decode(q, k, v, q_norm, k_norm, batch, states, layer, log_decay, scale, eps, theta)
        q, k = self.lightning_qk_norm_rope(q, k, q_norm, k_norm, batch.positions, eps, theta)
        if _has_verify(batch):
            return TorchBackend.gla(self, q, k, v, batch, states, layer, log_decay, scale)
        return self.gla(q, k, v, batch, states, layer, log_decay, scale)

    # ---- sparse layers -----------------------------------------------------------------------
    def store_kv(self, kv, layer, k, v, batch):
        attn.store_kv(kv, layer, k, v, batch)

    def update_compressed(self, kv, comp, layer, batch):
        attn.update_compressed(kv, comp, layer, batch)

    def sparse_attention(self, q, kv, comp, layer, batch, cfg):
        if batch.is_decode and not _has_verify(batch):
            return self._decode_attention(q, kv, comp, layer, batch, cfg)
        if _has_verify(batch):
            return TorchBackend.sparse_attention(self, q, kv, comp, layer, batch, cfg)
        return self._prefill_attention(q, kv, comp, layer, batch, cfg)

    @staticmethod
    def max_decode_blocks(cfg) -> int:
        """Longest page list of a decode query: every block of a dense sequence (L < dense_len),
        or the top-k selection of a sparse one."""
        sc = cfg.sparse
        return max(sc.topk_eff, -(-(sc.dense_len - 1) // sc.block_size))

    def select_blocks_decode(self, q, kv, comp, layer, batch, cfg):
        return sparse_ops.select_blocks_decode(q, comp, layer, batch.page_table, batch.seq_lens, cfg.sparse,
                                               cfg.head_dim ** -0.5, self.max_decode_blocks(cfg))

    def sparse_prefill(self, q, kv, comp, layer, batch, cfg):
        return sparse_ops.sparse_attention(q, kv, comp, layer, batch, cfg)

    def _decode_attention(self, q, kv, comp, layer, batch, cfg):
        """One token per sequence over a page list: all pages for dense sequences, the InfLLM-v2
        selection for sparse ones. Graph-safe."""
        sc, hkv = cfg.sparse, cfg.num_key_value_heads
        scale = cfg.head_dim ** -0.5
        sparse = batch.decode_mode == "sparse" or (batch.decode_mode is None and any(batch.is_sparse_host))
        if sparse:
            table, count = self.select_blocks_decode(q, kv, comp, layer, batch, cfg)
        else:
            if "dense_table" not in batch.derived:  # once per step, shared by the sparse layers
                batch.derived["dense_table"] = attn.dense_block_table(batch.page_table, batch.seq_lens, hkv,
                                                                      sc.block_size)
            table, count = batch.derived["dense_table"]
        # the split count depends only on static sizes, so eager and graph runs use the same kernels
        splits = attn.choose_num_splits(q.shape[0], hkv, self.max_decode_blocks(cfg))
        return attn.paged_decode_attention(q, kv, layer, table, count, batch.seq_lens, scale, splits)

    def _prefill_attention(self, q, kv, comp, layer, batch, cfg):
        """Eager steps: dense sequences through the flash kernel, sparse ones through InfLLM-v2."""
        scale = cfg.head_dim ** -0.5
        dense = [i for i, s in enumerate(batch.is_sparse_host) if not s]
        sparse = [i for i, s in enumerate(batch.is_sparse_host) if s]
        if not sparse:
            return attn.dense_prefill_attention(q, kv, layer, batch, scale)
        out = torch.empty_like(q)
        for group, fn in ((dense, "dense"), (sparse, "sparse")):
            if not group:
                continue
            sub, rows = batch.subset(group) if len(group) < batch.num_seqs else (batch, None)
            qs = q if rows is None else q[rows]
            if fn == "dense":
                o = attn.dense_prefill_attention(qs, kv, layer, sub, scale)
            else:
                o = self.sparse_prefill(qs, kv, comp, layer, sub, cfg)
            if rows is None:
                return o
            out[rows] = o
        return out
