"""CUDA graphs for decode and speculative verify: one captured graph per (batch size, tokens per
sequence, mode), all metadata in static buffers.

A decode step is ~32 layers x ~10 kernels; launched one by one from Python that costs more than
the kernels themselves at batch 1. Graphs are captured at start-up:
  - decode (1 token per sequence) for batch sizes 1, 2, 4, 8, 16, 24, 32, ... up to the running
    limit;
  - verify (n = 1 + draft tokens per sequence) for n = 2, 3, 5, 9, ... and 1 +
    speculative_num_draft_tokens, batch sizes up to speculative_max_batch, when speculation is on;
    the runner pads a verify step's sequences to the next captured n with filler tokens;
each in modes by page-table width: "dense" (every sequence below dense_len; a narrow table and
no block selection) and sparse ones (any mix; the decode graphs at several widths, since block
selection scans the whole table). A step of B sequences runs the smallest captured size >= B;
padding sequences read and write a scratch page and a scratch state slot reserved for them, and
their logits are dropped. Steps that mix verify with plain decode or prefill run eagerly (same
kernels, launched one by one).
"""

from __future__ import annotations

import logging
import time

import torch

from salaserve.core.batch import ForwardBatch, table_width
from salaserve.kernels.compile_watch import WATCH

log = logging.getLogger("salaserve")

BUFFERS_PER_TOKEN = ("input_ids", "positions", "slot_mapping")
# prompt_lens: a graph step's token is a prompt token when it is a one-token prefill chunk, whose
# stage-1 rule needs its prompt's length (decode and verify tokens lie past it: the decode rule)
BUFFERS_PER_SEQ = ("seq_lens", "cache_lens", "state_slots", "is_sparse", "prompt_lens")


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32]
    sizes += list(range(48, max_bs + 1, 16))
    out = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return out


SPARSE_WIDTHS = (272, 1040, 2064, 4112)  # pages: 16K, 64K, 128K, 256K contexts + slack for new tokens


def verify_lengths(max_tokens: int) -> list[int]:
    """Tokens per sequence with a verify graph: 1 + 1, 2, 4, 8, ... drafts, and the longest."""
    out = {n for n in (2, 3, 5, 9, 17, 33, 65) if n <= max_tokens}
    return sorted(out | {max_tokens}) if max_tokens >= 2 else []


class StepGraphs:
    """The captured decode and verify graphs of one model runner, and their static buffers."""

    def __init__(self, model, caches, max_bs: int, max_pages: int, dense_pages: int, scratch_page: int,
                 scratch_slot: int, device, max_verify_tokens: int = 1, verify_max_bs: int = 0):
        self.model = model
        self.caches = caches
        self.device = device
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        # verify graphs: n tokens per sequence (steps are padded up to the next n), batch sizes
        # <= verify_max_bs
        self.verify_ns = verify_lengths(max_verify_tokens) if verify_max_bs > 0 else []
        self.verify_sizes = [s for s in graph_batch_sizes(max(1, min(verify_max_bs, self.max_bs)))
                             if s <= verify_max_bs] if self.verify_ns else []
        # Page-table widths, one graph set each: "dense" (dense_len pages, no selection), sparse
        # widths in steps (block selection scans the whole width, ~0.09 ms per 1000 pages per
        # step, so a 128K context should not pay for a 512K one), and "sparse" = the context length.
        # (multiples of 16, as every eager batch's table: batch.table_width)
        dense_pages, max_pages = table_width(dense_pages), table_width(max_pages)
        self.widths = {"dense": dense_pages}
        for w in SPARSE_WIDTHS:
            if dense_pages < w < max_pages:
                self.widths[f"sparse{w}"] = w
        self.widths["sparse"] = max_pages
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_slot
        n = self.max_bs
        n_tok = max(n, max([bs * v for bs in self.verify_sizes for v in self.verify_ns], default=0))
        i32, i64 = torch.int32, torch.int64
        self.buf = {
            "input_ids": torch.zeros(n_tok, dtype=i64, device=device),
            "positions": torch.zeros(n_tok, dtype=i64, device=device),
            "slot_mapping": torch.zeros(n_tok, dtype=i64, device=device),
            "seq_lens": torch.ones(n, dtype=i32, device=device),
            "cache_lens": torch.zeros(n, dtype=i32, device=device),
            "state_slots": torch.zeros(n, dtype=i64, device=device),
            "is_sparse": torch.zeros(n, dtype=torch.bool, device=device),
            "prompt_lens": torch.zeros(n, dtype=i32, device=device),
        }
        # per tokens-per-sequence layouts (constant): offsets, the sequence of each row, logit rows
        self.layouts = {}
        for tokens in [1] + self.verify_ns:
            ar = torch.arange(n + 1, dtype=i32, device=device)
            self.layouts[tokens] = {
                "cu_seqlens_q": ar * tokens,
                "token_seq": torch.arange(n, dtype=i64, device=device).repeat_interleave(tokens),
                "logits_indices": torch.arange(n * tokens, dtype=i64, device=device),
            }
        self.verify_modes = torch.ones(n, dtype=i32, device=device)  # lightning_verify's VERIFY
        self.tables = {mode: torch.zeros(n, w, dtype=i32, device=device) for mode, w in self.widths.items()}
        # (bs, tokens per sequence, mode) -> (graph, logits, the static batch it was captured with)
        self.graphs: dict[tuple[int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        # rows >= this hold padding values (after capture: all of them); decode graphs refill
        # [B, padding_from) when fewer sequences run than last time
        self.padding_from = 0
        # sparse-mode graphs need a graph-safe block selection in the backend
        self.modes = tuple(self.widths) if hasattr(model.ops, "select_blocks_decode") else ("dense",)

    def _static_batch(self, bs: int, mode: str, tokens: int = 1) -> ForwardBatch:
        b, lay = self.buf, self.layouts[tokens]
        nt = bs * tokens
        verify = tokens > 1
        return ForwardBatch(
            input_ids=b["input_ids"][:nt], positions=b["positions"][:nt], cu_seqlens_q=lay["cu_seqlens_q"][:bs + 1],
            seq_lens=b["seq_lens"][:bs], cache_lens=b["cache_lens"][:bs], page_table=self.tables[mode][:bs],
            slot_mapping=b["slot_mapping"][:nt], state_slots=b["state_slots"][:bs], is_sparse=b["is_sparse"][:bs],
            logits_indices=lay["logits_indices"][:nt],
            # host mirrors are placeholders in graph mode (decode_mode tells kernels not to read them)
            q_lens_host=[tokens] * bs, seq_lens_host=[1] * bs, cache_lens_host=[0] * bs, is_sparse_host=[False] * bs,
            is_decode=not verify, decode_mode="dense" if mode == "dense" else "sparse", verify_host=[verify] * bs, spec_kv={}, derived={},
            token_seq=lay["token_seq"][:nt] if verify else None, seq_modes=self.verify_modes[:bs] if verify else None,
            prompt_lens=b["prompt_lens"][:bs], prompt_lens_host=[0] * bs,
        )

    def _fill_padding(self, start: int, end: int, tokens: int = 1) -> None:
        """Sequences [start, end) become padding: one token (or `tokens`) at position 0 of a
        1-token sequence on the scratch page and scratch slot."""
        b = self.buf
        block = self.caches.kv.block_size
        rows = slice(start * tokens, end * tokens)
        b["input_ids"][rows] = 0
        b["positions"][rows] = 0
        b["slot_mapping"][rows] = self.scratch_page * block
        b["seq_lens"][start:end] = 1
        b["cache_lens"][start:end] = 0
        b["state_slots"][start:end] = self.scratch_slot
        b["is_sparse"][start:end] = False
        b["prompt_lens"][start:end] = 0
        for t in self.tables.values():
            t[start:end] = 0
            t[start:end, 0] = self.scratch_page

    def _keys(self) -> list[tuple[int, int, str]]:
        keys = [(bs, 1, mode) for mode in self.modes for bs in self.sizes]
        keys += [(bs, n, mode) for mode in self._verify_modes() for n in self.verify_ns for bs in self.verify_sizes]
        # largest first, so smaller graphs reuse its memory pool
        return sorted(keys, key=lambda k: (k[0] * k[1], k[0]), reverse=True)

    @torch.no_grad()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self._fill_padding(0, self.max_bs, max([1] + self.verify_ns))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs, tokens, mode in self._keys():
                t = time.perf_counter()
                batch = self._static_batch(bs, mode, tokens)
                for _ in range(2):  # compile / autotune outside the capture
                    self.model.forward(batch, self.caches)
                graph = torch.cuda.CUDAGraph()
                batch.spec_kv.clear()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    logits = self.model.forward(batch, self.caches)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(bs, tokens, mode)] = (graph, logits, batch)
                WATCH.record("graph", f"step bs={bs} tokens={tokens} {mode}", seconds=time.perf_counter() - t)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (decode batch sizes %s; verify %s x tokens %s; modes %s) in %.1f s",
                 len(self.graphs), self.sizes, self.verify_sizes or "-", self.verify_ns or "-", "/".join(self.modes),
                 self.capture_seconds)

    def _verify_modes(self) -> tuple[str, ...]:
        return tuple(m for m in ("dense", "sparse") if m in self.modes)  # fewer graphs: no width steps

    def _mode(self, batch: ForwardBatch, tokens: int = 1) -> str:
        width = batch.page_table.shape[1]
        if not any(batch.is_sparse_host) and width <= self.widths["dense"]:
            return "dense"
        allowed = self.modes if tokens == 1 else self._verify_modes()
        return min((m for m in allowed if m != "dense" and self.widths[m] >= width),
                   key=lambda m: self.widths[m], default="sparse")

    def _tokens_per_seq(self, batch: ForwardBatch) -> int | None:
        """1 for a decode batch, n for a verify batch where every sequence verifies n tokens, None
        for anything else (mixed steps run eagerly)."""
        if batch.is_decode and not any(batch.verify_host or ()):
            return 1
        lens = set(batch.q_lens_host)
        if len(lens) == 1 and all(batch.verify_host or ()):
            return lens.pop()
        return None

    def can_run(self, batch: ForwardBatch) -> bool:
        if batch.trees:  # draft trees run eagerly: the verify graphs hold chains
            return False
        tokens = self._tokens_per_seq(batch)
        if tokens is None or self._mode(batch, tokens) not in self.modes:
            return False
        # A graph returns the logits of every row, in order. A one-token chunk that does not
        # sample (a prefill cut to one token by the budget or the pages) has no logits row in the
        # batch, and the rows after it would be misread: such steps run eagerly.
        if batch.logits_indices.shape[0] != batch.num_seqs * tokens:
            return False
        if tokens == 1:
            return batch.num_seqs <= self.max_bs
        return tokens in self.verify_ns and batch.num_seqs <= (self.verify_sizes[-1] if self.verify_sizes else 0)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph for this batch; logits of its real rows. For verify, the batch's
        spec_kv becomes the graph's (what commit_verified reads)."""
        B = batch.num_seqs
        tokens = self._tokens_per_seq(batch)
        sizes = self.sizes if tokens == 1 else self.verify_sizes
        bs = next(s for s in sizes if s >= B)
        mode = self._mode(batch, tokens)
        b = self.buf
        for name in BUFFERS_PER_TOKEN:
            b[name][:B * tokens].copy_(getattr(batch, name), non_blocking=True)
        for name in BUFFERS_PER_SEQ:
            b[name][:B].copy_(getattr(batch, name), non_blocking=True)
        # columns past a sequence's last page may hold stale ids: kernels never read them
        width = min(batch.page_table.shape[1], self.tables[mode].shape[1])  # (columns past the pages are 0)
        self.tables[mode][:B, :width].copy_(batch.page_table[:, :width], non_blocking=True)
        if tokens == 1:
            self.padding_from = max(self.padding_from, B)
            if bs > B and self.padding_from > B:
                self._fill_padding(B, self.padding_from)
                self.padding_from = B
        elif bs > B:  # verify rows are laid out by n: refill the padding sequences every time
            self._fill_padding(B, bs, tokens)
            self.padding_from = max(self.padding_from, B * tokens)  # token rows a decode may find dirty
        graph, logits, static = self.graphs[(bs, tokens, mode)]
        graph.replay()
        if tokens > 1:
            batch.spec_kv = static.spec_kv
        return logits[:B * tokens]
