"""What bounds the per-token sparse prefill attention? (GPU only)

    python scripts/sparse_attn_bound.py [--cache 122880] [--chunk 8192] [--reps 10]

One 8K-token chunk at the end of a 128K prompt (bench_sparse's set-up: random q and caches, pages
scattered, so the scored blocks are random as on dummy weights). The per-token kernel alone
(every listed block, no window kernel) is timed on
  random    each token's own selection (random across tokens: little reuse in L2)
  shared    every token given the chunk's first token's list (the same blocks: the K/V come from L2)
with the bytes it requests (blocks x 32 KiB per (token, KV head)) over its time. If `shared` is
much faster at the same instruction count, the kernel is bound by where its K/V come from (L2
misses on random blocks), not by its own latency; if not, by its per-block latency.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salaserve.kernels import bench_sparse as B  # noqa: E402
from salaserve.kernels import sparse as ks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    B.last_chunk_args(ap)
    a = ap.parse_args()
    cfg, comp, kv, batch, q = B.last_chunk_case(a.cache, a.chunk)
    sc = cfg.sparse
    scale = cfg.head_dim ** -0.5
    idx = ks.select_blocks_prefill(q, comp, 0, batch, sc, scale)
    shared = idx[:, :1, :].expand_as(idx).contiguous()
    block_bytes = 2 * sc.block_size * cfg.head_dim * 2  # K and V of one block, one KV head, bf16

    def per_token(blocks):
        return ks.sparse_prefill_attention(q, kv, 0, batch, blocks, scale, tile_tokens=0, window_tokens=0)

    def window_and_per_token():
        return ks.sparse_prefill_attention(q, kv, 0, batch, idx, scale, window=(sc.init_blocks, sc.local_blocks),
                                           ascending=True, tile_tokens=0, window_tokens=ks.SPARSE_ATTN_WINDOW)

    print(f"chunk {a.chunk} at {(a.cache + a.chunk) // 1024}K; {idx.shape[-1]} entries per (token, KV head)")
    print(f"{'variant':26s} {'us':>9s} {'GB requested':>13s} {'TB/s':>6s} {'distinct blocks':>16s}")
    for name, fn, blocks in (("per-token, random", lambda: per_token(idx), idx),
                             ("per-token, shared", lambda: per_token(shared), shared),
                             ("window + per-token", window_and_per_token, idx)):
        us = B._time_us(fn, a.reps)
        n = int((blocks >= 0).sum())
        gb = n * block_bytes / 1e9
        distinct = sum(int(torch.unique(blocks[g][blocks[g] >= 0]).numel()) for g in range(blocks.shape[0]))
        print(f"{name:26s} {us:9.1f} {gb:13.2f} {gb / us * 1e3:6.2f} {distinct:16d}")


if __name__ == "__main__":
    main()
