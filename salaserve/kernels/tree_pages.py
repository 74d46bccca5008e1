"""Tree verify on the paged kernels: every tree row reads the cache through a page table of its own.

Row r of a draft tree (spec/tree.py) is the decode query of its root-to-row path (kernels/tree_verify.py
is the ground truth): it must see the cache up to the root, then its path's K/V at positions
cache_len + 1 .. cache_len + depth(r), and the compressed entries that path completes. Siblings share
positions, so they cannot share the sequence's pages. Each non-root row therefore gets private copies
(scratch pages, handed out by the runner for the step) of the pages its path rewrites: from the page
of the first compressed entry its path completes (an entry lives in the page its window starts in)
or the root's page, whichever comes first, to the page of its deepest position. Per sparse layer:
copy the real pages into the row's copies, write the path's K/V there, compute the entries the path
completes there (the compression kernel on a batch of rows); then the decode kernels (selection,
paged attention) read the row through its table as any decode query.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from salaserve.cache.compressed import num_entries
from salaserve.core.batch import tree_row_depths


def row_spans(cache_len: int, parents, sc) -> list[tuple[int, int]]:
    """Per verify row of a tree whose root sits at cache_len: the page indices [lo, hi] (inclusive)
    of the sequence its path rewrites; (0, -1) (none) for the root."""
    c, bs = cache_len, sc.block_size
    out = [(0, -1)]
    levels = ((sc.kernel_size, sc.kernel_stride), (sc.c2_kernel_size, sc.c2_kernel_stride))
    for d in tree_row_depths(parents)[1:]:
        lo = c // bs
        for kernel, stride in levels:
            first = num_entries(c + 1, kernel, stride)  # the first entry the path may complete
            if num_entries(c + 1 + d, kernel, stride) > first:
                lo = min(lo, first * stride // bs)
        out.append((lo, (c + d) // bs))
    return out


def scratch_pages_needed(cache_lens, trees, sc) -> int:
    """Scratch pages a step needs: the sum of its tree rows' spans (trees[i] None: no tree)."""
    return sum(hi - lo + 1 for c, parents in zip(cache_lens, trees) if parents is not None
               for lo, hi in row_spans(c, parents, sc))


@dataclass(frozen=True)
class Scratch:
    """The scratch pages the runner hands a tree step (batch.tree_scratch) and the sparse config
    that sized them."""

    pages: list[int]
    sc: object  # SparseConfig


@dataclass
class TreePlan:
    """What every sparse layer of a tree step reuses (device tensors, built once per step)."""

    row_table: torch.Tensor  # [N, P] int32: every token row's page table (tree rows: with their copies)
    copy_src: torch.Tensor  # [S] int64: real pages copied ...
    copy_dst: torch.Tensor  # [S] int64: ... into these scratch pages
    path_rows: torch.Tensor  # [K] int64: token rows whose K/V a tree row's path holds ...
    path_slots: torch.Tensor  # [K] int64: ... and the scratch slots they go to
    rows_batch: SimpleNamespace  # the non-root tree rows as sequences for the compression kernel
    root_slots: torch.Tensor  # [N] int64: the step's slot mapping with -1 for non-root tree rows


def build_plan(batch, scratch: list[int], sc) -> TreePlan:
    """The per-row tables and copy lists of a tree step (eager: reads the host mirrors). scratch:
    at least scratch_pages_needed(...) page ids that nothing else uses during the step."""
    dev, bs = batch.page_table.device, sc.block_size
    tab_r, tab_c, tab_v, src_seq, src_page, dst = [], [], [], [], [], []
    p_rows, p_slots, skip = [], [], []
    r_tab, r_c, r_len = [], [], []
    nxt, start = 0, 0
    for i, n in enumerate(batch.q_lens_host):
        parents = batch.trees[i]
        if parents is None:
            start += n
            continue
        c = batch.cache_lens_host[i]
        depths = tree_row_depths(parents)
        for r, (lo, hi) in enumerate(row_spans(c, parents, sc)):
            if r == 0:
                continue
            skip.append(start + r)
            mine = {}
            for p in range(lo, hi + 1):
                mine[p] = scratch[nxt]
                tab_r.append(start + r)
                tab_c.append(p)
                tab_v.append(scratch[nxt])
                src_seq.append(i)
                src_page.append(p)
                dst.append(scratch[nxt])
                nxt += 1
            path = [r]
            while path[-1]:
                path.append(parents[path[-1] - 1] + 1)
            for t, row in enumerate(path[::-1][1:], start=1):  # depth t sits at position c + t
                pos = c + t
                p_rows.append(start + row)
                p_slots.append(mine[pos // bs] * bs + pos % bs)
            r_tab.append(start + r)
            r_c.append(c + 1)
            r_len.append(c + 1 + depths[r])
        start += n
    if nxt > len(scratch):
        raise ValueError(f"tree step needs {nxt} scratch pages, got {len(scratch)}")

    def t64(x):
        return torch.tensor(x, dtype=torch.int64, device=dev)

    table = batch.page_table[batch.token_seq].to(torch.int32)
    if tab_r:
        table[t64(tab_r), t64(tab_c)] = torch.tensor(tab_v, dtype=torch.int32, device=dev)
    src = batch.page_table[t64(src_seq), t64(src_page)].to(torch.int64)
    root_slots = batch.slot_mapping.clone()
    if skip:
        root_slots[t64(skip)] = -1
    rows_batch = SimpleNamespace(
        num_seqs=len(r_tab), is_decode=False, page_table=table[t64(r_tab)],
        seq_lens=torch.tensor(r_len, dtype=torch.int32, device=dev),
        cache_lens=torch.tensor(r_c, dtype=torch.int32, device=dev), seq_lens_host=r_len, cache_lens_host=r_c)
    return TreePlan(table, src, t64(dst), t64(p_rows), t64(p_slots), rows_batch, root_slots)


def plan(batch) -> TreePlan | None:
    """build_plan over the step's batch.tree_scratch, or None without enough pages."""
    scratch = batch.tree_scratch
    if scratch is None or len(scratch.pages) < scratch_pages_needed(batch.cache_lens_host, batch.trees, scratch.sc):
        return None
    return build_plan(batch, scratch.pages, scratch.sc)
