"""Time InfLLM-v2 selection and sparse prefill attention on the GPU next to their floors.

    python -m benchmarks.bench_sparse [--reps 20] [--quick] [--prefill-only | --decode-only]

Real config (block 64, C1 32/16, C2 128/64, topk_eff 96, 32 query / 2 KV heads x 128), one sparse
layer, random bf16 caches (timings do not depend on the values), pages scattered over the pool.
Floors (shared/reference/anchors.md): decode selection reads every C1 and C2 entry once,
bytes / 4.27 TB/s; prefill selection and attention are tl.dot work, FLOPs / 700 TFLOP/s (the bf16
dense rate is ~790; 700 is what a good attention kernel reaches). Prefill attention is timed with
the per-token kernel alone and after the window kernel (4 and 8 tokens per program; 8 is the
default). Decode selection is also timed replayed from a CUDA graph, as the engine runs it.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.config import preset_config
from salaserve.core.batch import ForwardBatch, SeqWork
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
    """The top-k kernel(s) alone on one set of packed keys. Floor: the keys' bytes."""
    sc = cfg.sparse
    nb = -(-context // sc.block_size)
    hkv = cfg.num_key_value_heads
    keys = ks.pack_keys(torch.randn(hkv, batch, nb, generator=gen)).to(DEVICE)
    table = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb).to(DEVICE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)

    def run():
        ks.topk_pages(keys, table, seq_lens, sc, 128)

    return [dict(op=f"decode top-k B={batch}", shape=f"ctx {context // 1024}K", us=_time_us(run, reps),
                 graph_us=graph_time_us(lambda i: run(), repeats=reps),
                 floor_us=keys.numel() * 4 / HBM_BYTES_PER_S * 1e6, floor="bytes")]


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


def bench_prefill_attention(cfg, cache_len: int, chunk: int, reps: int, gen, windows=(4, 8)) -> list[dict]:
    """The per-token kernel over every selected block, and the window kernel (forced blocks per tile of
    `windows` tokens) + the per-token kernel over the others, on one selection."""
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
    variants = [("per-token", dict(window=None))]
    variants += [(f"window {w}", dict(window=(sc.init_blocks, sc.local_blocks), window_tokens=w)) for w in windows]
    for name, kw in variants:
        us = _time_us(lambda: ks.sparse_prefill_attention(q, kv, 0, batch, idx, scale, ascending=True, **kw), reps)
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
    variants = dict(windows=args.windows)
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
