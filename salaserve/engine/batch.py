"""Per-step metadata: one ForwardBatch describes every sequence's tokens in a model forward.

Tokens of all sequences are packed into one flat [N] axis (varlen). Decode sequences contribute
one token, prefill chunks many; each sequence carries its page table, state slot and total length.
Kernels read only this object, so the scheduler and the caches stay out of the model code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqWork:
    """One sequence's share of a step (host side, built by the scheduler)."""

    state_slot: int
    pages: list[int]
    cache_len: int  # tokens already in the caches
    token_ids: list[int]  # tokens fed this step
    need_logits: bool  # sample after this step (last chunk of a prefill, or decode)
    num_logits: int = 1  # rows at the end of token_ids whose logits are needed (k+1 when verifying)
    verify: bool = False  # speculative verify: the last sampled token followed by draft tokens
    # verify only: the last pad_tokens of token_ids are filler that makes every sequence of the step
    # verify the same number of tokens (one CUDA graph); they repeat the last real position, store
    # their k/v on the batch's pad slot, and are not part of the sequence
    pad_tokens: int = 0

    @property
    def seq_len(self) -> int:
        return self.cache_len + len(self.token_ids) - self.pad_tokens


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, total length after this step
    cache_lens: torch.Tensor  # [B] int32, length before this step
    page_table: torch.Tensor  # [B, max_pages] int32 (padded with 0)
    slot_mapping: torch.Tensor  # [N] int64: page * block_size + offset of each new token
    state_slots: torch.Tensor  # [B] int64
    is_sparse: torch.Tensor  # [B] bool: total length >= dense_len (InfLLM-v2 path this step)
    logits_indices: torch.Tensor  # [M] int64: rows of [N] whose logits are sampled
    # host mirrors, so the torch backend and the runner never sync on the device tensors
    q_lens_host: list[int]
    seq_lens_host: list[int]
    cache_lens_host: list[int]
    is_sparse_host: list[bool]
    is_decode: bool  # every sequence feeds exactly one token
    # Speculative verify, per sequence: Lightning layers compute outputs without committing the
    # state (their k/v go to spec_kv for the replay of the accepted prefix), and each query token
    # chooses dense or sparse attention by its own position, as plain decoding would.
    verify_host: list[bool] = None
    # what a verify step keeps for the commit of the accepted tokens (backend-specific: the torch
    # backend keys (lightning layer idx, seq idx) -> (k, v); the triton one stacks all layers)
    spec_kv: dict = None
    # Set when any sequence verifies: the sequence of each token row [N] int64, and per sequence
    # [B] int32 how the recurrent kernels treat it (lightning_verify's SKIP / VERIFY / DECODE).
    token_seq: torch.Tensor | None = None
    seq_modes: torch.Tensor | None = None
    derived: dict = None  # per-step tensors kernels derive once and share across layers
    # Set only for CUDA-graph decode batches, whose host mirrors are placeholders: kernels must then
    # read the device tensors alone. "dense": every sequence is below dense_len and page_table is
    # dense_len / block_size wide; "sparse": any mix, page_table spans the context length.
    decode_mode: str | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, work: list[SeqWork], block_size: int, dense_len: int, device,
              pad_slot: int | None = None) -> "ForwardBatch":
        """pad_slot: the KV slot (page * block_size + offset) that filler tokens write."""
        ids, pos, slot_map, logit_rows = [], [], [], []
        cu = [0]
        for w in work:
            n = len(w.token_ids)
            ids.extend(w.token_ids)
            for p in range(w.cache_len, w.seq_len):
                pos.append(p)
                slot_map.append(w.pages[p // block_size] * block_size + p % block_size)
            if w.pad_tokens:
                if pad_slot is None:
                    raise ValueError("filler tokens need a pad_slot")
                pos.extend([w.seq_len - 1] * w.pad_tokens)
                slot_map.extend([pad_slot] * w.pad_tokens)
            cu.append(cu[-1] + n)
            if w.need_logits:
                logit_rows.extend(range(cu[-1] - w.num_logits, cu[-1]))
        max_pages = max(len(w.pages) for w in work)
        table = [w.pages + [0] * (max_pages - len(w.pages)) for w in work]
        seq_lens = [w.seq_len for w in work]
        sparse = [L >= dense_len for L in seq_lens]

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

        token_seq = seq_modes = None
        if any(w.verify for w in work):
            token_seq = t([i for i, w in enumerate(work) for _ in w.token_ids], torch.int64)
            # 1 = verify (state read only), 2 = one plain decode token (state written), 0 = a chunk
            seq_modes = t([1 if w.verify else 2 if len(w.token_ids) == 1 else 0 for w in work], torch.int32)

        return cls(
            input_ids=t(ids, torch.int64), positions=t(pos, torch.int64), cu_seqlens_q=t(cu, torch.int32),
            seq_lens=t(seq_lens, torch.int32), cache_lens=t([w.cache_len for w in work], torch.int32),
            page_table=t(table, torch.int32), slot_mapping=t(slot_map, torch.int64),
            state_slots=t([w.state_slot for w in work], torch.int64), is_sparse=t(sparse, torch.bool),
            logits_indices=t(logit_rows, torch.int64),
            q_lens_host=[len(w.token_ids) for w in work], seq_lens_host=seq_lens,
            cache_lens_host=[w.cache_len for w in work], is_sparse_host=sparse,
            is_decode=all(len(w.token_ids) == 1 for w in work),
            verify_host=[w.verify for w in work], spec_kv={}, derived={}, token_seq=token_seq,
            seq_modes=seq_modes,
        )

    def subset(self, seqs: list[int]) -> tuple["ForwardBatch", torch.Tensor]:
        """The batch restricted to some sequences (eager steps only), and the token rows they own
        in this batch, to scatter results back."""
        starts = [0]
        for n in self.q_lens_host:
            starts.append(starts[-1] + n)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs]).to(self.input_ids.device)
        idx = torch.tensor(seqs, device=self.input_ids.device)
        q_lens = [self.q_lens_host[i] for i in seqs]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        sub = ForwardBatch(
            input_ids=self.input_ids[rows], positions=self.positions[rows],
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=rows.device),
            seq_lens=self.seq_lens[idx], cache_lens=self.cache_lens[idx], page_table=self.page_table[idx],
            slot_mapping=self.slot_mapping[rows], state_slots=self.state_slots[idx],
            is_sparse=self.is_sparse[idx], logits_indices=rows.new_zeros(0),
            q_lens_host=q_lens, seq_lens_host=[self.seq_lens_host[i] for i in seqs],
            cache_lens_host=[self.cache_lens_host[i] for i in seqs],
            is_sparse_host=[self.is_sparse_host[i] for i in seqs],
            is_decode=all(n == 1 for n in q_lens),
            verify_host=[self.verify_host[i] for i in seqs] if self.verify_host else None,
            spec_kv=self.spec_kv, derived={},
        )
        return sub, rows
