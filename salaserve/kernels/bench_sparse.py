"""Time InfLLM-v2 selection and sparse prefill attention on the GPU next to their floors.

    python -m salaserve.kernels.bench_sparse [--reps 20] [--quick] [--prefill-only | --decode-only]

Real config (block 64, C1 32/16, C2 128/64, topk_eff 96, 32 query / 2 KV heads x 128), one sparse
layer, random bf16 caches (timings do not depend on the values), pages scattered over the pool.
Floors (shared/reference/anchors.md): decode selection reads every C1 and C2 entry once,
bytes / 4.27 TB/s; prefill selection and attention are tl.dot work, FLOPs / 700 TFLOP/s (the bf16
dense rate is ~790; 700 is what a good attention kernel reaches). Prefill attention is timed with
the per-token kernel (tile 0) and the tile kernel (4 and 8 tokens per program). Decode selection is also timed
replayed from a CUDA graph, as the engine runs it.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.config import preset_config
from salaserve.engine.batch import ForwardBatch, SeqWork
from salaserve.kernels import sparse as ks
from salaserve.kernels.timing import graph_time_us

DEVICE = "cuda"
HBM_BYTES_PER_S = 4.27e12
DOT_FLOPS_PER_S = 700e12


def _time_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _pools(cfg, num_pages: int, with_kv: bool, gen: torch.Generator):
    sc, hkv, d = cfg.sparse, cfg.num_key_value_heads, cfg.head_dim
    comp = CompressedKeyPool(sc, 1, num_pages, hkv, d, torch.bfloat16, DEVICE)
    comp.c1.copy_(torch.randn(comp.c1.shape, generator=gen).to(torch.bfloat16))
    comp.c2.copy_(torch.randn(comp.c2.shape, generator=gen).to(torch.bfloat16))
    kv = None
    if with_kv:
        kv = KVPool(1, num_pages, sc.block_size, hkv, d, torch.bfloat16, DEVICE)
        kv.k.normal_()
        kv.v.normal_()
    return comp, kv


def bench_decode(cfg, context: int, batch: int, reps: int, gen) -> dict:
    sc = cfg.sparse
    pages_per_seq = -(-context // sc.block_size)
    comp, _ = _pools(cfg, batch * pages_per_seq, False, gen)
    table = torch.randperm(batch * pages_per_seq, generator=gen).view(batch, pages_per_seq).int().to(DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    scale = cfg.head_dim ** -0.5

    def run():
        ks.select_blocks_decode(q, comp, 0, table, seq_lens, sc, scale, max_sel=128)

    n1, n2 = comp.counts(context)
    bytes_ = batch * (n1 + n2) * cfg.num_key_value_heads * cfg.head_dim * 2
    return dict(op=f"decode select B={batch}", shape=f"ctx {context // 1024}K", us=_time_us(run, reps),
                graph_us=graph_time_us(lambda i: run(), repeats=reps), floor_us=bytes_ / HBM_BYTES_PER_S * 1e6,
                floor="bytes")


def bench_decode_topk(cfg, context: int, batch: int, reps: int, gen) -> list[dict]:
    """The top-k kernel(s) alone on one set of packed keys, with each threshold search
    (SALASERVE_TOPK_SEARCH), in the same process: an A/B of the two. Floor: the keys' bytes."""
    sc = cfg.sparse
    nb = -(-context // sc.block_size)
    hkv = cfg.num_key_value_heads
    keys = ks.pack_keys(torch.randn(hkv, batch, nb, generator=gen)).to(DEVICE)
    table = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb).to(DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    rows = []
    for search in ("key", "score"):
        def run():
            ks.topk_pages(keys, table, seq_lens, sc, 128, search=search)

        rows.append(dict(op=f"decode top-k {search} B={batch}", shape=f"ctx {context // 1024}K",
                         us=_time_us(run, reps), graph_us=graph_time_us(lambda i: run(), repeats=reps),
                         floor_us=keys.numel() * 4 / HBM_BYTES_PER_S * 1e6, floor="bytes"))
    return rows


def _prefill_setup(cfg, cache_len: int, chunk: int, gen, with_kv: bool):
    sc = cfg.sparse
    L = cache_len + chunk
    n_pages = -(-L // sc.block_size)
    comp, kv = _pools(cfg, n_pages + 7, with_kv, gen)
    pages = torch.randperm(n_pages + 7, generator=gen)[:n_pages].tolist()
    work = [SeqWork(state_slot=0, pages=pages, cache_len=cache_len, token_ids=[0] * chunk, need_logits=True)]
    batch = ForwardBatch.build(work, sc.block_size, sc.dense_len, DEVICE)
    q = torch.randn(chunk, cfg.num_attention_heads, cfg.head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    return comp, kv, batch, q


def last_chunk_args(ap: argparse.ArgumentParser) -> None:
    """The A/B scripts' shared options (scripts/sparse_launch_ab.py, scripts/sparse_attn_bound.py):
    one prefill chunk of --chunk tokens after --cache cached tokens, timed --reps times."""
    ap.add_argument("--cache", type=int, default=120 * 1024)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)


def last_chunk_case(cache_len: int, chunk: int, seed: int = 0):
    """(cfg, comp, kv, batch, q) of one chunk at the end of a long prompt, real config: random bf16
    caches and queries, pages scattered (see _prefill_setup)."""
    cfg = preset_config("full")
    comp, kv, batch, q = _prefill_setup(cfg, cache_len, chunk, torch.Generator().manual_seed(seed), with_kv=True)
    return cfg, comp, kv, batch, q


def correlated_selection(qb: torch.Tensor, hkv: int, sc, keep: float, seed: int = 0) -> torch.Tensor:
    """Block lists [hkv, N, topk_eff] int32 (ascending) for N consecutive tokens of one sequence in
    query blocks qb [N] (each past the local window), shaped like InfLLM-v2's selection: the
    init blocks, the local window qb - local .. qb, and topk_eff minus those scored blocks from
    [init, qb - local). Token t keeps each of token t-1's scored blocks with probability `keep`
    (if still in range) and draws the rest at random: keep 0 is what dummy weights give (unrelated
    neighbours), keep near 1 what attention locality on real weights could give. For timing the
    attention kernels against the overlap of neighbouring tokens' lists (scripts/sparse_overlap_ab.py)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    init, local, topk = sc.init_blocks, sc.local_blocks, sc.topk_eff
    n_scored = topk - init - (local + 1)
    qbs = qb.tolist()
    if min(qbs) - local < init + n_scored:
        raise ValueError("every token needs at least topk_eff blocks before its local window")
    out = np.empty((hkv, len(qbs), topk), dtype=np.int32)
    for g in range(hkv):
        prev = np.empty(0, dtype=np.int64)
        for t, b in enumerate(qbs):
            hi = b - local  # scored blocks lie in [init, hi)
            kept = prev[(rng.random(prev.size) < keep) & (prev < hi)]
            pool = np.setdiff1d(np.arange(init, hi), kept, assume_unique=True)
            scored = np.concatenate([kept, rng.choice(pool, n_scored - kept.size, replace=False)])
            out[g, t] = np.sort(np.concatenate([np.arange(init), scored, np.arange(hi, b + 1)]))
            prev = scored
    return torch.from_numpy(out).to(qb.device)


def neighbour_overlap(idx: torch.Tensor) -> float:
    """Mean fraction of a token's list that the previous token's list also holds (lists [hkv, N,
    W], -1 padded)."""
    a, b = idx[:, 1:, :, None], idx[:, :-1, None, :]
    shared = ((a == b) & (a >= 0)).any(-1).sum(-1).float()
    return float((shared / (idx[:, 1:] >= 0).sum(-1).clamp(min=1)).mean())


def bench_prefill_select(cfg, cache_len: int, chunk: int, reps: int, gen) -> list[dict]:
    sc = cfg.sparse
    comp, _, batch, q = _prefill_setup(cfg, cache_len, chunk, gen, with_kv=False)
    scale = cfg.head_dim ** -0.5
    pos = batch.positions.double()
    vis1 = ((pos + 1 - sc.kernel_size) // sc.kernel_stride + 1).clamp(min=0)
    vis2 = ((pos + 1 - sc.c2_kernel_size) // sc.c2_kernel_stride + 1).clamp(min=0)
    flops = float(2 * cfg.num_attention_heads * cfg.head_dim * (vis1 + vis2).sum())
    floor = flops / DOT_FLOPS_PER_S * 1e6
    shape = f"chunk {chunk} at {(cache_len + chunk) // 1024}K"
    nb = -(-batch.seq_lens_host[0] // sc.block_size)
    block_t, bb = ks.STAGE1_PREFILL_TILE
    tiles = ks.tile_tensors(ks._prefill_tiles(batch, block_t), DEVICE)

    def scores_only():  # the two stage-1 kernels, without top-k (one chunk: fits the key buffer)
        ks._stage1_keys(q, comp, 0, batch.page_table, batch.seq_lens, batch.positions, tiles, chunk, 0, nb,
                        scale, block_t, bb, launch=ks.STAGE1_PREFILL_LAUNCH)

    total = _time_us(lambda: ks.select_blocks_prefill(q, comp, 0, batch, sc, scale), reps)
    return [dict(op="prefill select: kernels", shape=shape, us=_time_us(scores_only, reps), floor_us=floor,
                 floor="flops"),
            dict(op="prefill select: + top-k", shape=shape, us=total, floor_us=floor, floor="flops")]


def bench_prefill_attention(cfg, cache_len: int, chunk: int, reps: int, gen, tiles=(0, 4, 8),
                            windows=(4, 8)) -> list[dict]:
    """The per-token kernel (tile 0), the tile kernel at each tile size, and the window kernel
    (forced blocks per tile of `windows` tokens) + the per-token kernel, on one selection."""
    sc = cfg.sparse
    comp, kv, batch, q = _prefill_setup(cfg, cache_len, chunk, gen, with_kv=True)
    scale = cfg.head_dim ** -0.5
    idx = ks.select_blocks_prefill(q, comp, 0, batch, sc, scale)
    # keys attended: full selected blocks, except the current one which stops at the query
    nblk = (idx >= 0).sum(-1).double()  # [Hkv, N]
    in_cur = (batch.positions % sc.block_size + 1).double()
    keys = ((nblk - 1) * sc.block_size + in_cur[None]).sum()
    group = cfg.gqa_group_size
    flops = float(4 * group * cfg.head_dim * keys)
    rows = []
    shape = f"chunk {chunk} at {(cache_len + chunk) // 1024}K"
    variants = [(f"tile {t}", dict(tile_tokens=t, window_tokens=0)) for t in tiles]
    variants += [(f"window {w}", dict(tile_tokens=0, window_tokens=w)) for w in windows]
    for name, kw in variants:
        us = _time_us(lambda: ks.sparse_prefill_attention(q, kv, 0, batch, idx, scale,
                                                          window=(sc.init_blocks, sc.local_blocks), ascending=True,
                                                          **kw), reps)
        rows.append(dict(op=f"sparse prefill attn, {name}", shape=shape, us=us,
                         floor_us=flops / DOT_FLOPS_PER_S * 1e6, floor="flops"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode rows")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill rows")
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=None, help="decode rows: contexts (tokens)")
    ap.add_argument("--tiles", type=int, nargs="*", default=[0, 4, 8],
                    help="attention rows: tokens per program of the tile kernel (0: the per-token kernel)")
    ap.add_argument("--windows", type=int, nargs="*", default=[4, 8],
                    help="attention rows: tokens per program of the window kernel")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sparse needs a CUDA GPU")
    cfg = preset_config("full")
    gen = torch.Generator().manual_seed(0)
    K = 1024
    rows = []
    contexts = args.decode_contexts or ([32 * K] if args.quick else [32 * K, 128 * K, 512 * K])
    for ctx in [] if args.prefill_only else contexts:
        for b in (1, 8):
            rows.append(bench_decode(cfg, ctx, b, args.reps, gen))
            rows += bench_decode_topk(cfg, ctx, b, args.reps, gen)
    chunk, total = (2048, 16 * K) if args.quick else (8192, 128 * K)
    variants = dict(tiles=args.tiles, windows=args.windows)
    if not args.decode_only:
        rows += bench_prefill_select(cfg, total - chunk, chunk, args.reps, gen)
        rows += bench_prefill_attention(cfg, total - chunk, chunk, args.reps, gen, **variants)
    if not (args.quick or args.decode_only):
        rows += bench_prefill_attention(cfg, 16 * K, 2048, args.reps, gen, **variants)

    print(f"{'op':28s} {'shape':20s} {'us':>10s} {'graph us':>10s} {'floor us':>10s} {'floor':>6s} {'floor/us':>9s}")
    for r in rows:
        g = f"{r['graph_us']:10.1f}" if "graph_us" in r else f"{'':10s}"
        best = min(r["us"], r.get("graph_us", r["us"]))
        print(f"{r['op']:28s} {r['shape']:20s} {r['us']:10.1f} {g} {r['floor_us']:10.1f} {r['floor']:>6s} "
              f"{r['floor_us'] / best:9.1%}")


if __name__ == "__main__":
    main()
