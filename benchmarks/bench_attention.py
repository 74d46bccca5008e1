"""Times the kernels of salaserve/kernels/attention/ on the GPU next to their floors.

    python -m benchmarks.bench_attention            # the standard table
    python -m benchmarks.bench_attention --sweep    # + prefill tile configs and decode splits

Floors: bytes moved / 4.27 TB/s (store_kv, update_compressed, decode) and FLOPs / 700 TFLOP/s
(dense prefill: 4 * d * Hq per causal (query, key) pair). Decode-path kernels are timed inside a
CUDA graph (several calls per graph, so one graph launch is amortised), the rest with
triton.testing.do_bench. Decode runs rotate over enough layers of the pool that their K/V does not
sit in L2 (>= 256 MB touched per graph), so the times are HBM times.
Shapes are MiniCPM-SALA's sparse layers: Hq=32, Hkv=2, d=128, pages of 64 tokens, bf16.
"""

from __future__ import annotations

import argparse
import random

import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.config import SparseConfig
from salaserve.core.batch import ForwardBatch, SeqWork
from salaserve.kernels import attention as A
from salaserve.kernels.attention.compress import _entries
from salaserve.kernels.timing import graph_time_us
from salaserve.kernels.torch_ops import TorchBackend

HQ, HKV, D, BS = 32, 2, 128, 64
DT = torch.bfloat16
BW = 4.27e12  # B/s, measured device-to-device copy (reference/anchors.md)
MM = 700e12  # FLOP/s, bf16 tensor cores (what the brief asks the prefill to be measured against)
L2_FLUSH_BYTES = 256 << 20
DEV = "cuda"

STORE_CASES = ((1, True), (8, True), (64, True), (8192, False))  # (tokens, timed in a graph)
PREFILL_CASES = [[(0, 1024)], [(0, 4096)], [(0, 8192)], [(4096, 4096)], [(1024, 8192)], [(0, 2048)] * 4,
                 [(6000, 64)], [(8000, 16)] * 8]  # [(cache_len, q_len)] per sequence
DECODE_BATCHES = (1, 8, 64)
DECODE_CASES = (("dense", 1024), ("dense", 4096), ("dense", 8191), ("sparse96", 32768), ("sparse96", 131072))

ROWS: list[tuple] = []


def row(kernel, case, t_s, floor_s, note=""):
    ROWS.append((kernel, case, t_s * 1e6, floor_s * 1e6, 100.0 * floor_s / t_s, note))
    print(f"  {kernel:<22} {case:<38} {t_s * 1e6:10.1f} us  floor {floor_s * 1e6:9.1f} us  "
          f"{100.0 * floor_s / t_s:5.1f}%  {note}", flush=True)


def make_batch(seqs, num_pages, seed=0):
    rnd = random.Random(seed)
    free = list(range(1, num_pages))
    rnd.shuffle(free)
    work = []
    for i, (c, n) in enumerate(seqs):
        need = -(-(c + n) // BS)
        pages, free = free[:need], free[need:]
        work.append(SeqWork(state_slot=i, pages=pages, cache_len=c, token_ids=[0] * n, need_logits=True))
    return ForwardBatch.build(work, BS, dense_len=1 << 30, device=DEV)


def pages_for(seqs):
    return sum(-(-(c + n) // BS) for c, n in seqs) + 1


def make_kv(n_layers, num_pages):
    kv = KVPool(n_layers, num_pages, BS, HKV, D, DT, DEV)
    kv.k.normal_()
    kv.v.normal_()
    return kv


def graph_time(fn, calls: int) -> float:
    """Seconds per call of fn(i) inside a CUDA graph (mean over 20 replays)."""
    return graph_time_us(fn, calls, replays=20, repeats=1) * 1e-6


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100) / 1e3


# ---------------------------------------------------------------------------------------------


def bench_store_kv():
    print("store_kv", flush=True)
    torch_ops = TorchBackend()
    for n, graph in STORE_CASES:
        seqs = [(1000, 1)] * n if n <= 64 else [(0, n)]
        num_pages = pages_for(seqs)
        kv = make_kv(1, num_pages)
        batch = make_batch(seqs, num_pages)
        fused = torch.randn(batch.num_tokens, HQ * D * 2 + 2 * HKV * D, device=DEV, dtype=DT)
        k = fused[:, HQ * D:HQ * D + HKV * D].view(-1, HKV, D)  # strided views, as in the model
        v = fused[:, HQ * D + HKV * D:HQ * D + 2 * HKV * D].view(-1, HKV, D)
        floor = 2 * 2 * batch.num_tokens * HKV * D * 2 / BW  # K and V, read + write
        for name, f in (("triton", lambda i: A.store_kv(kv, 0, k, v, batch)),
                        ("torch index_put", lambda i: torch_ops.store_kv(kv, 0, k, v, batch))):
            try:
                t = graph_time(f, 20) if graph else bench(lambda: f(0))
            except Exception as e:  # pragma: no cover - informative only
                print(f"  {name}: {type(e).__name__}: {e}")
                continue
            row("store_kv", f"N={n} {'graph' if graph else 'eager'}", t, floor, name)


def bench_update_compressed():
    print("update_compressed", flush=True)
    sc = SparseConfig()
    cases = [("decode B=1 (C1+C2 born)", [(8191, 1)], True), ("decode B=64 (C1+C2 born)", [(8191, 1)] * 64, True),
             ("prefill 8192 from 0", [(0, 8192)], False), ("prefill 4x2048 over 2048", [(2048, 2048)] * 4, False)]
    for case, seqs, graph in cases:
        num_pages = pages_for(seqs)
        kv = make_kv(1, num_pages)
        comp = CompressedKeyPool(sc, 1, num_pages, HKV, D, DT, DEV)
        batch = make_batch(seqs, num_pages)
        entries = sum(_entries(c + n, k, s) - _entries(c, k, s)
                      for c, n in seqs for k, s in ((sc.kernel_size, sc.kernel_stride),
                                                    (sc.c2_kernel_size, sc.c2_kernel_stride)))
        read = sum((_entries(c + n, k, s) - _entries(c, k, s)) * k
                   for c, n in seqs for k, s in ((sc.kernel_size, sc.kernel_stride),
                                                 (sc.c2_kernel_size, sc.c2_kernel_stride)))
        floor = (read + entries) * HKV * D * 2 / BW
        f = lambda i: A.update_compressed(kv, comp, 0, batch)  # noqa: E731
        t = graph_time(f, 20) if graph else bench(lambda: f(0))
        row("update_compressed", case, t, floor, f"{entries} entries")


def prefill_flops(seqs):
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
    return 4 * D * HQ * pairs


def bench_prefill(sweep: bool):
    print("dense_prefill_attention", flush=True)
    for seqs in PREFILL_CASES:
        num_pages = pages_for(seqs)
        kv = make_kv(1, num_pages)
        batch = make_batch(seqs, num_pages)
        q = torch.randn(batch.num_tokens, HQ, D, device=DEV, dtype=DT)
        fl = prefill_flops(seqs)
        label = "+".join(f"{n}@{c}" for c, n in seqs[:1]) + (f" x{len(seqs)}" if len(seqs) > 1 else "")
        t = bench(lambda: A.dense_prefill_attention(q, kv, 0, batch, D ** -0.5))
        row("dense_prefill", f"q {label}", t, fl / MM, f"{fl / t / 1e12:6.1f} TFLOP/s")
        if len(seqs) == 1 and seqs[0][0] == 0:  # torch SDPA (flash) on contiguous K/V as a bar
            n = seqs[0][1]
            kc, vc = kv.gather(0, batch.page_table[0, : -(-n // BS)].long(), n)
            qt, kt, vt = q.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
            f = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qt, kt, vt, is_causal=True, enable_gqa=True)
            t = bench(f)
            row("  torch sdpa (contig)", f"q {label}", t, fl / MM, f"{fl / t / 1e12:6.1f} TFLOP/s")
        if sweep and seqs in ([(0, 8192)], [(0, 2048)] * 4, [(8000, 16)] * 8):
            best = None
            for bm in (64, 128):
                for bn in (32, 64, 128):
                    for w in (4, 8):
                        for st in (2, 3, 4):
                            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
                            try:
                                t = bench(lambda: A.dense_prefill_attention(q, kv, 0, batch, D ** -0.5, config=cfg))
                            except Exception as e:
                                print(f"    {cfg}: {type(e).__name__}")
                                continue
                            print(f"    {cfg}: {t * 1e6:9.1f} us  {fl / t / 1e12:6.1f} TFLOP/s", flush=True)
                            if best is None or t < best[0]:
                                best = (t, cfg)
            if best:
                row("dense_prefill best", f"q {label}", best[0], fl / MM, str(best[1]))


def bench_decode(sweep: bool):
    print("paged_decode_attention (CUDA graph)", flush=True)
    for B in DECODE_BATCHES:
        for mode, ctx in DECODE_CASES:
            seqs = [(ctx - 1, 1)] * B
            num_pages = pages_for(seqs)
            per_layer = num_pages * BS * HKV * D * 2 * 2  # K and V bytes of one pool layer
            touched = B * HKV * (96 if mode == "sparse96" else -(-ctx // BS)) * BS * D * 2 * 2
            layers = max(1, min(256, -(-L2_FLUSH_BYTES // touched)))
            if layers * per_layer > (40 << 30):
                layers = max(1, (40 << 30) // per_layer)
            kv = make_kv(layers, num_pages)
            batch = make_batch(seqs, num_pages)
            q = torch.randn(B, HQ, D, device=DEV, dtype=DT)
            if mode == "dense":
                table, count = A.dense_block_table(batch.page_table, batch.seq_lens, HKV, BS)
                max_sel = batch.page_table.shape[1]
            else:  # 96 blocks: the first, the 33 last, 62 random others, ascending
                nb = -(-ctx // BS)
                table = torch.empty(B, HKV, 96, dtype=torch.int32)
                pt = batch.page_table.cpu()
                for b in range(B):
                    for h in range(HKV):
                        mid = sorted(random.Random(b * 7 + h).sample(range(1, nb - 33), 62))
                        blocks = [0] + mid + list(range(nb - 33, nb))
                        table[b, h] = pt[b, blocks]
                table = table.to(DEV)
                count = torch.full((B, HKV), 96, dtype=torch.int32, device=DEV)
                max_sel = 96
            floor = touched / BW
            chosen = A.choose_num_splits(B, HKV, max_sel)
            splits_list = sorted({1, 2, 4, 8, 16, 32, 64, chosen}) if sweep else sorted({1, chosen})
            if mode == "dense" and B == 1 and ctx == 1024:  # its few torch ops, once
                t = graph_time(lambda i: A.dense_block_table(batch.page_table, batch.seq_lens, HKV, BS), 20)
                row("dense_block_table", f"B={B}", t, 0.0, "torch ops, graph")
            for splits in splits_list:
                def f(i, splits=splits):
                    A.paged_decode_attention(q, kv, i % layers, table, count, batch.seq_lens, D ** -0.5, splits)

                t = graph_time(f, calls=max(layers, 10))
                note = f"splits={splits}" + (" (chosen)" if splits == chosen else "")
                row("paged_decode", f"{mode} B={B} ctx={ctx}", t, floor, note)
            del kv
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also sweep prefill tile configs and decode splits")
    ap.add_argument("--only", choices=["store", "compress", "prefill", "decode"], default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}", flush=True)
    if args.only in (None, "store"):
        bench_store_kv()
    if args.only in (None, "compress"):
        bench_update_compressed()
    if args.only in (None, "prefill"):
        bench_prefill(args.sweep)
    if args.only in (None, "decode"):
        bench_decode(args.sweep)
    print("\n| kernel | case | time (us) | floor (us) | floor/time | note |")
    print("|---|---|---:|---:|---:|---|")
    for k, c, t, f, p, n in ROWS:
        print(f"| {k.strip()} | {c} | {t:.1f} | {f:.1f} | {p:.0f}% | {n} |")


if __name__ == "__main__":
    main()
