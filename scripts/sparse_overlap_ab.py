"""Sparse prefill attention against how much neighbouring tokens' block lists overlap (GPU only).

    python scripts/sparse_overlap_ab.py [--cache 122880] [--chunk 8192] [--reps 10]
                                        [--keep 0,0.5,0.8,0.95,1] [--tiles 2,4,8]

One 8K-token chunk at the end of a 128K prompt (bench_sparse's set-up). The lists are synthetic
(`bench_sparse.correlated_selection`): InfLLM-v2's forced blocks plus scored blocks, each token
keeping a fraction `keep` of its predecessor's scored blocks. Times, per keep:
  default   the window kernel (forced blocks once per 8 tokens) + the per-token kernel
  tile T    the tile kernel: T consecutive tokens per program walk the union of their lists, so a
            block they share is read once (SALASERVE_SPARSE_ATTN_TILE)
with each output compared with the default's. Why: on dummy weights the lists of neighbours
are unrelated (keep ~0) and the per-token kernel is bound by L2 -> SM traffic (runs 56-57). On
real weights neighbours should share much of their lists. Where the tile kernel wins, and from
what overlap, decides whether the engine should pick it (by measuring the overlap) for real
checkpoints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salaserve.kernels import bench_sparse as B  # noqa: E402
from salaserve.kernels import sparse as ks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    B.last_chunk_args(ap)
    ap.add_argument("--keep", default="0,0.5,0.8,0.95,1")
    ap.add_argument("--tiles", default="2,4,8")
    a = ap.parse_args()
    cfg, comp, kv, batch, q = B.last_chunk_case(a.cache, a.chunk)
    sc = cfg.sparse
    scale = cfg.head_dim ** -0.5
    qb = batch.positions // sc.block_size
    tiles = [int(t) for t in a.tiles.split(",")]

    def attention(idx, tile):
        return ks.sparse_prefill_attention(q, kv, 0, batch, idx, scale, window=(sc.init_blocks, sc.local_blocks),
                                           ascending=True, tile_tokens=tile,
                                           window_tokens=0 if tile else ks.SPARSE_ATTN_WINDOW)

    print(f"chunk {a.chunk} at {(a.cache + a.chunk) // 1024}K; us per call (median of {a.reps}), "
          f"max |diff| vs default")
    print(f"{'keep':>5} {'overlap':>8} {'default':>9} " + " ".join(f"{'tile ' + str(t):>18}" for t in tiles))
    for keep in (float(k) for k in a.keep.split(",")):
        idx = B.correlated_selection(qb, kv.k.shape[3], sc, keep)
        overlap = B.neighbour_overlap(idx)
        base = attention(idx, 0).float()
        cells = [f"{B._time_us(lambda: attention(idx, 0), a.reps):9.1f}"]
        for t in tiles:
            us = B._time_us(lambda: attention(idx, t), a.reps)
            diff = float((attention(idx, t).float() - base).abs().max())
            cells.append(f"{us:9.1f} ({diff:.1e})")
        print(f"{keep:>5.2f} {overlap:>8.3f} " + " ".join(f"{c:>18}" if i else c for i, c in enumerate(cells)))


if __name__ == "__main__":
    main()
