"""Tree verify on the torch backend: every row of a draft tree (spec/tree.py) computed as the
decode query of its own root-to-row path, the ground truth for any faster tree kernel.

A tree verify sequence feeds the root (its pending token, always accepted) and the candidates; row
r sits at position cache_len + depth(r), so siblings share a position and cannot share the paged
cache. Hence only the root's K/V go to the cache during the step; every row's K/V stay with the
batch (spec_kv) and the commit writes the accepted path's (`commit_tree_kv`). Meanwhile:
  - sparse layers: row r attends to the cache plus the K/V of its path, with the compressed
    entries its path completes computed from the path's keys, and the decode rule (dense iff the
    path's length < dense_len; stage 1 sees every complete entry): exactly a decode of that path;
  - Lightning layers: the recurrence replayed along the path from the live state (not committed).
An fp8 cache is the exception: path keys enter unquantized (chain verify differs from decode on
fp8 pages too, through the pages' scales).
"""

from __future__ import annotations

import torch

from salaserve.cache.compressed import num_entries
from salaserve.model import reference as spec
from salaserve.spec.tree import path_rows


def row_ranges(batch) -> list[tuple[int, int]]:
    """[start, end) of every sequence's rows in the flat token axis."""
    out, start = [], 0
    for n in batch.q_lens_host:
        out.append((start, start + n))
        start += n
    return out


def cache_write_rows(batch) -> torch.Tensor:
    """Rows whose K/V go to the cache this step: all but tree candidates (their root stays)."""
    if "tree_write_rows" not in batch.derived:
        keep = []
        for (start, end), tree in zip(row_ranges(batch), batch.trees):
            keep.extend(range(start, start + 1 if tree is not None else end))
        batch.derived["tree_write_rows"] = torch.tensor(keep, dtype=torch.long, device=batch.input_ids.device)
    return batch.derived["tree_write_rows"]


def born_entries(keys: torch.Tensor, first_len: int, kernel: int, stride: int, dtype) -> torch.Tensor:
    """Compressed entries completed between length first_len and len(keys), from these keys (the
    same mean as update_compressed): [m, kv_heads, d]."""
    a, b = num_entries(first_len, kernel, stride), num_entries(keys.shape[0], kernel, stride)
    return spec.window_means(keys, a, b, kernel, stride, dtype)


def root_caches(kv, comp, layer: int, batch, i: int):
    """K, V, C1, C2 of tree sequence i up to and including its root (what the step stored)."""
    c = batch.cache_lens_host[i]
    pages = batch.page_table[i, : -(-(c + 1) // kv.block_size)]
    return (*kv.gather(layer, pages, c + 1), *comp.gather(layer, pages, c + 1))


def path_caches(root, k_rows, v_rows, path: list[int], sc):
    """What a decode of a row's path reads: the root's caches (`root_caches`) extended by the K/V
    of the path's rows past the root, and the C1/C2 entries those complete."""
    keys_c, values_c, c1_c, c2_c = root
    keys = torch.cat([keys_c, k_rows[path].to(keys_c.dtype)])
    values = torch.cat([values_c, v_rows[path].to(values_c.dtype)])
    n0 = keys_c.shape[0]
    c1 = torch.cat([c1_c, born_entries(keys, n0, sc.kernel_size, sc.kernel_stride, c1_c.dtype)])
    c2 = torch.cat([c2_c, born_entries(keys, n0, sc.c2_kernel_size, sc.c2_kernel_stride, c2_c.dtype)])
    return keys, values, c1, c2


def tree_attention(q, kv, comp, layer: int, batch, i: int, cfg, score_reduce=None) -> torch.Tensor:
    """Sparse-layer outputs of tree sequence i's rows (q [n, Hq, d]) as decode queries of their paths
    (score_reduce: as TorchBackend.sparse_attention's)."""
    sc, bs = cfg.sparse, kv.block_size
    scale = cfg.head_dim ** -0.5
    k_rows, v_rows = batch.spec_kv[("kv", layer, i)]
    root = root_caches(kv, comp, layer, batch, i)
    plen = batch.prompt_lens_host[i] if batch.prompt_lens_host else 0
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        keys, values, c1, c2 = path_caches(root, k_rows, v_rows, path_rows(batch.trees[i], r)[1:], sc)
        L = keys.shape[0]
        qr = q[r:r + 1]
        if L < sc.dense_len:  # as plain decoding at position L - 1
            out[r:r + 1] = spec.attention(qr, keys, values, torch.ones(1, 1, L, dtype=torch.bool, device=q.device),
                                          scale)
            continue
        pos = torch.tensor([L - 1], device=q.device)
        vis1 = spec.visible_count(pos, sc.kernel_size, sc.kernel_stride, c1.shape[0], plen)
        vis2 = spec.visible_count(pos, sc.c2_kernel_size, sc.c2_kernel_stride, c2.shape[0], plen)
        scores = spec.stage1_scores(qr, c1, c2, vis1, vis2, cfg.gqa_group_size, scale, score_reduce)
        blocks = spec.select_blocks(scores, pos // bs, -(-L // bs), sc)
        allowed = blocks.repeat_interleave(bs, dim=-1)[..., :L]
        out[r:r + 1] = spec.attention(qr, keys, values, allowed, scale)
    return out


def tree_gla(q, k, v, parents, log_decay, state, scale) -> torch.Tensor:
    """Lightning outputs of a tree's rows (q, k, v [n, H, d] fp32) from the live state [H, dk, dv]:
    row r's is the last output of the recurrence over its path. o [n, H, d] fp32."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(q.shape[0]):
        path = path_rows(parents, r)
        o, _ = spec.gla_recurrent(q[path], k[path], v[path], log_decay, state, scale)
        out[r] = o[-1]
    return out


def commit_tree_kv(kv, comp, batch, commits, compress) -> None:
    """After a tree verify: each (seq index, slot, accepted rows) writes the K/V of the accepted
    rows past the root at positions cache_len + 1, ... in every sparse layer, then the compressed
    entries they complete (`compress(kv, comp, layer, pages, old_len, new_len)`)."""
    bs = kv.block_size
    for layer in range(kv.k.shape[0]):
        for i, _slot, rows in commits:
            k, v = batch.spec_kv.pop(("kv", layer, i))
            c = batch.cache_lens_host[i]
            if len(rows) > 1:
                pos = torch.arange(c + 1, c + len(rows), device=k.device)
                table = batch.page_table[i].to(torch.long)
                slots = table[pos // bs] * bs + pos % bs
                kv.write(layer, slots, k[rows[1:]], v[rows[1:]])
            compress(kv, comp, layer, batch.page_table[i], c + 1, c + len(rows))
