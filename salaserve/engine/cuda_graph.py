"""CUDA-graph decode: one captured graph per (batch size, mode), all metadata in static buffers.

A decode step is ~32 layers x ~10 kernels; launched one by one from Python that costs more than
the kernels themselves at batch 1. Graphs are captured at start-up for batch sizes 1, 2, 4, 8,
16, 24, 32, ... up to the running limit, in two modes: "dense" (every sequence below dense_len;
a narrow page table and no block selection) and "sparse" (any mix). A step of B sequences runs
the smallest captured size >= B; padding rows read and write a scratch page and a scratch state
slot reserved for them, and their logits are dropped.
"""

from __future__ import annotations

import logging
import time

import torch

from salaserve.engine.batch import ForwardBatch

log = logging.getLogger("salaserve")


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32]
    sizes += list(range(48, max_bs + 1, 16))
    out = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return out


class DecodeGraphs:
    def __init__(self, model, caches, max_bs: int, max_pages: int, dense_pages: int, scratch_page: int,
                 scratch_slot: int, device):
        self.model = model
        self.caches = caches
        self.device = device
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.widths = {"dense": dense_pages, "sparse": max_pages}
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_slot
        n = self.max_bs
        i32, i64 = torch.int32, torch.int64
        self.buf = {
            "input_ids": torch.zeros(n, dtype=i64, device=device),
            "positions": torch.zeros(n, dtype=i64, device=device),
            "seq_lens": torch.ones(n, dtype=i32, device=device),
            "cache_lens": torch.zeros(n, dtype=i32, device=device),
            "slot_mapping": torch.zeros(n, dtype=i64, device=device),
            "state_slots": torch.zeros(n, dtype=i64, device=device),
            "is_sparse": torch.zeros(n, dtype=torch.bool, device=device),
            "cu_seqlens_q": torch.arange(n + 1, dtype=i32, device=device),
            "logits_indices": torch.arange(n, dtype=i64, device=device),
        }
        self.tables = {mode: torch.zeros(n, w, dtype=i32, device=device) for mode, w in self.widths.items()}
        self.graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.padding_from = 0  # rows >= this hold padding values (after capture: all of them)
        # sparse-mode graphs need a graph-safe block selection in the backend
        self.modes = ("dense", "sparse") if hasattr(model.ops, "select_blocks_decode") else ("dense",)

    def _static_batch(self, bs: int, mode: str) -> ForwardBatch:
        b = self.buf
        return ForwardBatch(
            input_ids=b["input_ids"][:bs], positions=b["positions"][:bs], cu_seqlens_q=b["cu_seqlens_q"][:bs + 1],
            seq_lens=b["seq_lens"][:bs], cache_lens=b["cache_lens"][:bs], page_table=self.tables[mode][:bs],
            slot_mapping=b["slot_mapping"][:bs], state_slots=b["state_slots"][:bs], is_sparse=b["is_sparse"][:bs],
            logits_indices=b["logits_indices"][:bs],
            # host mirrors are placeholders in graph mode (decode_mode tells kernels not to read them)
            q_lens_host=[1] * bs, seq_lens_host=[1] * bs, cache_lens_host=[0] * bs, is_sparse_host=[False] * bs,
            is_decode=True, decode_mode=mode, verify_host=[False] * bs, spec_kv={}, derived={},
        )

    def _fill_padding(self, start: int, end: int) -> None:
        b = self.buf
        block = self.caches.kv.block_size
        b["input_ids"][start:end] = 0
        b["positions"][start:end] = 0
        b["seq_lens"][start:end] = 1
        b["cache_lens"][start:end] = 0
        b["slot_mapping"][start:end] = self.scratch_page * block
        b["state_slots"][start:end] = self.scratch_slot
        b["is_sparse"][start:end] = False
        for t in self.tables.values():
            t[start:end] = 0
            t[start:end, 0] = self.scratch_page

    @torch.no_grad()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self._fill_padding(0, self.max_bs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for mode in self.modes:
                for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
                    batch = self._static_batch(bs, mode)
                    for _ in range(2):  # compile / autotune outside the capture
                        self.model.forward(batch, self.caches)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        logits = self.model.forward(batch, self.caches)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[(bs, mode)] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch sizes %s, modes %s) in %.1f s",
                 len(self.graphs), self.sizes, "/".join(self.modes), self.capture_seconds)

    def _mode(self, batch: ForwardBatch) -> str:
        if any(batch.is_sparse_host) or batch.page_table.shape[1] > self.widths["dense"]:
            return "sparse"
        return "dense"

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.is_decode and batch.num_seqs <= self.max_bs and not any(batch.verify_host or ())
                and self._mode(batch) in self.modes)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph for this decode batch; logits of its real rows."""
        B = batch.num_seqs
        bs = next(s for s in self.sizes if s >= B)
        mode = self._mode(batch)
        b = self.buf
        for name in ("input_ids", "positions", "seq_lens", "cache_lens", "slot_mapping", "state_slots", "is_sparse"):
            b[name][:B].copy_(getattr(batch, name), non_blocking=True)
        # columns past a sequence's last page may hold stale ids: kernels never read them
        self.tables[mode][:B, : batch.page_table.shape[1]].copy_(batch.page_table, non_blocking=True)
        self.padding_from = max(self.padding_from, B)
        if bs > B and self.padding_from > B:
            self._fill_padding(B, self.padding_from)
            self.padding_from = B
        graph, logits = self.graphs[(bs, mode)]
        graph.replay()
        return logits[:B]
