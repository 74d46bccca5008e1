"""Per-step metadata: one ForwardBatch describes every sequence's tokens in a model forward.

Tokens of all sequences are packed into one flat [N] axis (varlen). Decode sequences contribute
one token, prefill chunks many; each sequence carries its page table, state slot and total length.
Kernels read only this object, so the scheduler and the caches stay out of the model code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from salaserve.core.staging import to_device

TABLE_ALIGN = 16


def table_width(pages: int) -> int:
    """A page table's width for `pages` pages: a multiple of 16 (at least 16). Triton specialises an
    int argument (a table's row stride among them) by whether it is 1, a multiple of 16 or
    neither; one class for every batch means one compiled kernel, warmed at start-up, instead of a
    compile on the first step that meets another class."""
    return max(TABLE_ALIGN, -(-pages // TABLE_ALIGN) * TABLE_ALIGN)


class PageTableMirror:
    """Every state slot's page list as a row of one int32 array, kept up to date with what each
    request appended since its last step. A step's page table is then one fancy index over the
    rows instead of a list-to-array copy per sequence (~1 us each; 0.1-0.2 ms a step at batch 128).

    It relies on how the scheduler treats page lists: a request's list only grows (extend), and a
    request that frees its pages gets a new list. A row is re-written from the start whenever its
    slot shows a different list object than last time (held here, so its id cannot be reused) or
    a shorter one."""

    def __init__(self, num_slots: int, max_pages: int):
        self.rows = np.zeros((num_slots, table_width(max_pages)), dtype=np.int32)
        self.owner: list[list[int] | None] = [None] * num_slots
        self.synced = [0] * num_slots  # entries of owner[slot] already in rows[slot]

    def covers(self, work: list["SeqWork"]) -> bool:
        return all(0 <= w.state_slot < len(self.owner) for w in work)

    def table(self, work: list["SeqWork"], width: int) -> np.ndarray:
        """[len(work), width] int32, row i = work[i].pages padded with 0."""
        for w in work:
            s, pages = w.state_slot, w.pages
            n = len(pages)
            if self.owner[s] is not pages or self.synced[s] > n:
                self.rows[s, :self.synced[s]] = 0  # the padding past a row's pages stays 0
                self.owner[s], self.synced[s] = pages, 0
            k = self.synced[s]
            if k < n:
                if n > self.rows.shape[1]:  # longer than planned (e.g. pages for draft tokens)
                    grown = np.zeros((self.rows.shape[0], table_width(max(n, 2 * self.rows.shape[1]))), dtype=np.int32)
                    grown[:, :self.rows.shape[1]] = self.rows
                    self.rows = grown
                self.rows[s, k:n] = pages[k:n]
                self.synced[s] = n
        slots = np.fromiter((w.state_slot for w in work), dtype=np.int64, count=len(work))
        return self.rows[slots, :width]


def tree_row_depths(parents) -> list[int]:
    """Depth of every verify row of a draft tree: the root (row 0) is 0, candidate i (row i + 1) one
    more than its parent candidate `parents[i]` (-1: the root)."""
    out = [0]
    for p in parents:
        out.append(out[p + 1] + 1)
    return out


@dataclass
class SeqWork:
    """One sequence's share of a step (host side, built by the scheduler)."""

    state_slot: int
    pages: list[int]
    cache_len: int  # tokens already in the caches
    token_ids: list[int]  # tokens fed this step
    need_logits: bool  # sample after this step (last chunk of a prefill, or decode)
    num_logits: int = 1  # rows at the end of token_ids whose logits are needed (k+1 when verifying)
    # prompt logprobs: token_ids[lo:hi] also need their logits (each row predicts the next prompt
    # token); their rows come before the sampled ones, and never overlap them
    prompt_rows: tuple[int, int] = (0, 0)
    verify: bool = False  # speculative verify: the last sampled token followed by draft tokens
    # verify only: the last pad_tokens of token_ids are filler that makes every sequence of the step
    # verify the same number of tokens (one CUDA graph); they repeat the last real position, store
    # their k/v on the batch's pad slot, and are not part of the sequence
    pad_tokens: int = 0
    # the request's prompt length: tokens at positions below it are prompt tokens, whose stage-1
    # visibility is the official single-shot prefill's (reference.visible_count); 0: none are
    prompt_len: int = 0
    # verify of a draft tree (spec/tree.py): token_ids are the root (the pending token) and the
    # candidates, tree_parents[i] the parent candidate of candidate i (-1: the root). Row r sits at
    # position cache_len + its depth (siblings share one). None: a chain (rows in order).
    tree_parents: tuple[int, ...] | None = None

    def tree_depths(self) -> list[int]:
        """Depth of every row of a tree verify (root 0)."""
        return tree_row_depths(self.tree_parents)

    @property
    def seq_len(self) -> int:
        if self.tree_parents is not None:  # the positions reach the deepest candidate's
            return self.cache_len + 1 + max(self.tree_depths())
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
    # [B] int32 (and its host mirror): each sequence's prompt length (SeqWork.prompt_len). Stage 1
    # shows its tokens below it the official single-shot prefill's entries, one fewer than the
    # natural rule when it is = stride - 1 (mod stride) (reference.visible_count); None: 0.
    prompt_lens: torch.Tensor | None = None
    prompt_lens_host: list[int] | None = None
    # Set only for CUDA-graph decode batches, whose host mirrors are placeholders: kernels must then
    # read the device tensors alone. "dense": every sequence is below dense_len and page_table is
    # dense_len / block_size wide; "sparse": any mix, page_table spans the context length.
    decode_mode: str | None = None
    # per sequence: SeqWork.tree_parents (None: not a tree verify); None when no sequence is one.
    # Only backends with supports_tree_verify get such batches.
    trees: list | None = None
    # a tree step on a backend that reads tree rows through private page copies: the scratch pages
    # the runner handed out for the step and the sparse config that sized them (kernels/tree_pages.py)
    tree_scratch: object = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, work: list[SeqWork], block_size: int, dense_len: int, device,
              pad_slot: int | None = None, pages: PageTableMirror | None = None) -> "ForwardBatch":
        """pad_slot: the KV slot (page * block_size + offset) that filler tokens write. pages: the
        runner's mirror of the page lists, which makes the page table without a copy per sequence."""
        B = len(work)
        q_lens = [len(w.token_ids) for w in work]
        cache_lens = [w.cache_len for w in work]
        seq_lens = [w.seq_len for w in work]
        max_pages = table_width(max(len(w.pages) for w in work))
        if pages is not None and pages.covers(work):
            table = pages.table(work, max_pages)
        else:
            table = np.zeros((B, max_pages), dtype=np.int32)
            for i, w in enumerate(work):
                table[i, :len(w.pages)] = w.pages
        cu = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        is_decode = all(n == 1 for n in q_lens)
        if is_decode and not any(w.pad_tokens or w.prompt_rows[1] > w.prompt_rows[0] for w in work):
            # the common step, without a Python loop per token
            ids = np.fromiter((w.token_ids[0] for w in work), dtype=np.int64, count=B)
            pos = np.array(cache_lens, dtype=np.int64)
            slot_map = table[np.arange(B), pos // block_size].astype(np.int64) * block_size + pos % block_size
            logit_rows = np.array([i for i, w in enumerate(work) if w.need_logits], dtype=np.int64)
        else:
            ids_l, pos_l, slot_l, rows_l = [], [], [], []
            for i, w in enumerate(work):
                if w.tree_parents is not None and (w.pad_tokens or not w.verify):
                    raise ValueError("a draft tree is a verify sequence without filler tokens")
                ids_l.extend(w.token_ids)
                # a tree's rows sit at cache_len + depth: siblings share a position (and its slot,
                # which the backend writes only for the accepted path, at the commit)
                rows_pos = (range(w.cache_len, w.seq_len) if w.tree_parents is None
                            else [w.cache_len + d for d in w.tree_depths()])
                for p in rows_pos:
                    pos_l.append(p)
                    slot_l.append(w.pages[p // block_size] * block_size + p % block_size)
                if w.pad_tokens:
                    if pad_slot is None:
                        raise ValueError("filler tokens need a pad_slot")
                    pos_l.extend([w.seq_len - 1] * w.pad_tokens)
                    slot_l.extend([pad_slot] * w.pad_tokens)
                lo, hi = w.prompt_rows
                rows_l.extend(range(int(cu[i]) + lo, int(cu[i]) + hi))
                if w.need_logits:
                    rows_l.extend(range(int(cu[i + 1]) - w.num_logits, int(cu[i + 1])))
            ids, pos = np.array(ids_l, dtype=np.int64), np.array(pos_l, dtype=np.int64)
            slot_map, logit_rows = np.array(slot_l, dtype=np.int64), np.array(rows_l, dtype=np.int64)
        sparse = [L >= dense_len for L in seq_lens]
        prompt_lens = [w.prompt_len for w in work]
        fields = [ids, pos, cu, np.array(seq_lens, dtype=np.int32), np.array(cache_lens, dtype=np.int32), table,
                  slot_map, np.array([w.state_slot for w in work], dtype=np.int64), np.array(sparse, dtype=np.bool_),
                  logit_rows, np.array(prompt_lens, dtype=np.int32)]
        token_seq = seq_modes = None
        verify = any(w.verify for w in work)
        if verify:
            fields.append(np.repeat(np.arange(B, dtype=np.int64), q_lens))
            # 1 = verify (state read only), 2 = one plain decode token (state written), 0 = a chunk
            fields.append(np.array([1 if w.verify else 2 if len(w.token_ids) == 1 else 0 for w in work],
                                   dtype=np.int32))
        out = to_device(fields, device)
        if verify:
            token_seq, seq_modes = out[11], out[12]
        return cls(
            input_ids=out[0], positions=out[1], cu_seqlens_q=out[2], seq_lens=out[3], cache_lens=out[4],
            page_table=out[5], slot_mapping=out[6], state_slots=out[7], is_sparse=out[8], logits_indices=out[9],
            q_lens_host=q_lens, seq_lens_host=seq_lens, cache_lens_host=cache_lens, is_sparse_host=sparse,
            is_decode=is_decode, verify_host=[w.verify for w in work], spec_kv={}, derived={},
            token_seq=token_seq, seq_modes=seq_modes, prompt_lens=out[10], prompt_lens_host=prompt_lens,
            trees=[w.tree_parents for w in work] if any(w.tree_parents is not None for w in work) else None,
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
            prompt_lens=self.prompt_lens[idx] if self.prompt_lens is not None else None,
            prompt_lens_host=[self.prompt_lens_host[i] for i in seqs] if self.prompt_lens_host else None,
            trees=[self.trees[i] for i in seqs] if self.trees else None,
        )
        return sub, rows
