"""Cases for tests/test_kernels_sparse.py, shared by the interpreter run (a subprocess with
TRITON_INTERPRET=1, tiny config, fp32) and the GPU run (real config, bf16).

Each `check_*` function builds random caches and a batch, runs a kernel from
the salaserve/kernels/sparse package and its reference twin, and returns a dict of statistics; the tests
assert on them. Run as a script, it executes the interpreter cases and prints one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.config import ModelConfig, preset_config
from salaserve.core.batch import ForwardBatch, SeqWork
from salaserve.model import reference as spec

LAYER = 1  # a layer other than 0, so that layer offsets are exercised


def tiny_cfg(**sparse) -> ModelConfig:
    cfg = preset_config("tiny")
    return dataclasses.replace(cfg, sparse=dataclasses.replace(cfg.sparse, **sparse)) if sparse else cfg


def make_case(cfg: ModelConfig, seqs: list[tuple[int, ...]], seed: int, dtype=torch.float32, device="cpu",
              structured: bool = True, spare_pages: int = 3) -> dict:
    """Random K/V for every position of each sequence (cache_len + q_len tokens), C1/C2 built
    from them as the engine would, pages scattered randomly over the pool, and random queries
    for the q_len new tokens. `structured` adds a random per-block offset to the keys so that block
    scores spread out (pure noise gives mostly tied bf16 scores, also worth testing). A third
    number in a sequence's tuple is its prompt length (SeqWork.prompt_len; default 0)."""
    sc = cfg.sparse
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d = sc.block_size, cfg.num_key_value_heads, cfg.head_dim
    need = [-(-(c + n) // bs) for c, n, *_ in seqs]
    num_pages = sum(need) + spare_pages
    kv = KVPool(2, num_pages, bs, hkv, d, dtype, device)
    comp = CompressedKeyPool(sc, 2, num_pages, hkv, d, dtype, device)
    perm = torch.randperm(num_pages, generator=g).tolist()
    work, start = [], 0
    for i, ((cache_len, q_len, *prompt_len), n_pages) in enumerate(zip(seqs, need)):
        pages = perm[start:start + n_pages]
        start += n_pages
        L = cache_len + q_len
        keys = torch.randn(L, hkv, d, generator=g)
        if structured:
            keys += 2.0 * torch.randn(n_pages, hkv, d, generator=g).repeat_interleave(bs, 0)[:L]
        keys = keys.to(dtype)  # what the cache holds; C1/C2 are means of these (spec 3.3)
        values = torch.randn(L, hkv, d, generator=g)
        pt = torch.tensor(pages)
        flat = pt.repeat_interleave(bs)[:L] * bs + torch.arange(L) % bs
        for layer in range(2):
            kv.k[layer].view(-1, hkv, d)[flat.to(device)] = keys.to(device)
            kv.v[layer].view(-1, hkv, d)[flat.to(device)] = values.to(device, dtype)
            for pool, kernel, stride, per_page in ((comp.c1, sc.kernel_size, sc.kernel_stride, comp.c1_per_page),
                                                   (comp.c2, sc.c2_kernel_size, sc.c2_kernel_stride,
                                                    comp.c2_per_page)):
                c = spec.compress_keys(keys, kernel, stride)
                j = torch.arange(c.shape[0])
                pool[layer, pt[j // per_page].to(device), (j % per_page).to(device)] = c.to(device, dtype)
        work.append(SeqWork(state_slot=i, pages=pages, cache_len=cache_len, token_ids=[5] * q_len,
                            need_logits=True, prompt_len=prompt_len[0] if prompt_len else 0))
    batch = ForwardBatch.build(work, bs, sc.dense_len, device)
    n = batch.num_tokens
    q = torch.randn(n, cfg.num_attention_heads, d, generator=g)
    q = q + 1.5 * torch.randn(1, cfg.num_attention_heads, d, generator=g)  # a shared direction per head
    return dict(cfg=cfg, kv=kv, comp=comp, batch=batch, q=q.to(device, dtype))


def _seq_slices(batch: ForwardBatch):
    start = 0
    for i, n in enumerate(batch.q_lens_host):
        L = batch.seq_lens_host[i]
        yield i, slice(start, start + n), L
        start += n


def reference_block_scores(case: dict, decode: bool = False, natural: bool = False):
    """Per sequence: the reference block scores [G, T, nb] and selection mask [G, T, nb]
    (decode=True: one query per sequence at its last position; natural=True: prompt tokens by
    the decode rule, ignoring the sequence's prompt length, as a contrast)."""
    cfg, comp, batch, q = case["cfg"], case["comp"], case["batch"], case["q"]
    sc, scale, bs = cfg.sparse, cfg.head_dim ** -0.5, cfg.sparse.block_size
    out = []
    for i, sl, L in _seq_slices(batch):
        nb = -(-L // bs)
        pages = batch.page_table[i, :nb]
        c1, c2 = comp.gather(LAYER, pages, L)
        qi = q[i:i + 1] if decode else q[sl]
        pos = torch.tensor([L - 1], device=q.device) if decode else batch.positions[sl]
        plen = 0 if natural else batch.prompt_lens_host[i]
        vis1 = spec.visible_count(pos, sc.kernel_size, sc.kernel_stride, c1.shape[0], plen)
        vis2 = spec.visible_count(pos, sc.c2_kernel_size, sc.c2_kernel_stride, c2.shape[0], plen)
        scores = spec.stage1_scores(qi.float(), c1.float(), c2.float(), vis1, vis2, cfg.gqa_group_size, scale)
        bscores = spec.block_scores(scores, pos // bs, nb, sc)
        out.append((bscores, spec.select_from_block_scores(bscores, pos // bs, sc)))
    return out


def _mask_from_idx(idx: torch.Tensor, nb: int) -> torch.Tensor:
    """[..., W] block indices (-1 unused) -> bool [..., nb]."""
    m = torch.zeros(*idx.shape[:-1], nb + 1, dtype=torch.bool, device=idx.device)
    m.scatter_(-1, torch.where(idx < 0, nb, idx).long(), True)
    return m[..., :nb]


def _ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between bf16-valued fp32 tensors of equal sign (inf == inf)."""
    ia = a.to(torch.bfloat16).view(torch.int16).int()
    ib = b.to(torch.bfloat16).view(torch.int16).int()
    return (ia - ib).abs()


def _new_stats() -> dict:
    return dict(rows=0, rows_differ=0, rows_unexplained=0, rule_mismatch=0, blocks=0, blocks_common=0,
                scores=0, score_exact=0, score_max_ulp=0)


def _compare(stats: dict, kscores, mine, bref, mref, qb, sc) -> None:
    """Accumulate the comparison of one sequence's rows [G, T, nb]: kernel block scores `kscores`
    (unpacked keys) and selection mask `mine` against the reference's `bref`, `mref`.

    score_exact: causal block scores bit-equal to the reference's; score_max_ulp: the largest
    difference in bf16 steps; rule_mismatch: rows whose kernel selection differs from the reference
    rule applied to the kernel's OWN scores (pooling/top-k/tie logic: must be 0); rows_differ:
    rows whose selection differs from the reference; rows_unexplained: those among them whose
    block scores are all bit-equal to the reference's (must be 0: only rounding may differ)."""
    nb = bref.shape[-1]
    causal = (torch.arange(nb, device=qb.device)[None, :] <= qb[:, None])[None].expand_as(bref)
    same = (kscores == bref) | (kscores.isinf() & bref.isinf() & (kscores.sign() == bref.sign()))
    stats["scores"] += int(causal.sum())
    stats["score_exact"] += int((same & causal).sum())
    finite = causal & bref.isfinite() & kscores.isfinite()
    if finite.any():
        stats["score_max_ulp"] = max(stats["score_max_ulp"], int(_ulp_diff(kscores[finite], bref[finite]).max()))
    if (~same & causal & ~finite).any():
        stats["score_max_ulp"] = 1 << 20  # an infinity where the reference has a finite value
    stats["rule_mismatch"] += int((spec.select_from_block_scores(kscores, qb, sc) != mine).any(-1).sum())
    differ = (mine != mref).any(-1)  # [G, T]
    stats["rows"] += differ.numel()
    stats["rows_differ"] += int(differ.sum())
    stats["rows_unexplained"] += int((differ & (same | ~causal).all(-1)).sum())
    stats["blocks"] += int(mref.sum())
    stats["blocks_common"] += int((mref & mine).sum())


def check_prefill_selection(case: dict, block_t: int = 4, bb: int = 32) -> dict:
    """select_blocks_prefill against reference.stage1_scores + select_blocks (see `_compare`),
    plus the output layout: ascending valid entries, -1 only at the end."""
    from salaserve.kernels import sparse as ks

    cfg, comp, batch, q = case["cfg"], case["comp"], case["batch"], case["q"]
    sc, scale = cfg.sparse, cfg.head_dim ** -0.5
    idx = ks.select_blocks_prefill(q, comp, LAYER, batch, sc, scale, block_t=block_t, bb=bb)
    nb_out = max(-(-L // sc.block_size) for L in batch.seq_lens_host)
    tiles = ks.tile_tensors(ks._prefill_tiles(batch, block_t), q.device)
    keys = ks._stage1_keys(q, comp, LAYER, batch.page_table, batch.seq_lens, batch.positions, tiles,
                           batch.num_tokens, 0, nb_out, scale, block_t, bb, prompt_lens=batch.prompt_lens)
    kscores, kblocks = ks.unpack_keys(keys)
    stats = _new_stats()
    # natural_differ / natural_scores_differ: rows whose selection / block scores the natural rule
    # (prompt lengths ignored) would change
    stats.update(sorted_ok=True, width=idx.shape[-1], dense_rows_ok=True, natural_differ=0, natural_scores_differ=0)
    naturals = reference_block_scores(case, natural=True) if any(batch.prompt_lens_host) else None
    for (i, sl, L), (bref, mref) in zip(_seq_slices(batch), reference_block_scores(case)):
        if naturals is not None:
            stats["natural_differ"] += int((naturals[i][1] != mref).any(-1).sum())
            stats["natural_scores_differ"] += int((naturals[i][0] != bref).any(-1).sum())
        nb = bref.shape[-1]
        assert torch.equal(kblocks[:, sl, :nb].long(), torch.arange(nb, device=q.device).expand_as(bref))
        mine = _mask_from_idx(idx[:, sl], nb)
        qb = batch.positions[sl] // sc.block_size
        if batch.is_sparse_host[i]:
            _compare(stats, kscores[:, sl, :nb], mine, bref, mref, qb, sc)
        else:  # a dense sequence lists every causal block
            causal = torch.arange(nb, device=q.device)[None, :] <= qb[:, None]
            stats["dense_rows_ok"] &= bool((mine == causal[None]).all())
        valid = idx[:, sl] >= 0
        stats["sorted_ok"] &= bool((idx[:, sl][..., 1:] > idx[:, sl][..., :-1])[valid[..., 1:]].all())
        stats["sorted_ok"] &= bool((valid[..., 1:] <= valid[..., :-1]).all())  # -1 only at the end
    return stats


def check_decode_selection(case: dict, max_sel: int, bb: int = 16) -> dict:
    """select_blocks_decode against the reference selection at each sequence's last position (see
    `_compare`), plus the output contract: shapes/dtypes, ascending pages ending with the last
    page, 0 padding, every block listed for dense sequences. One query per sequence: q[i]."""
    from salaserve.kernels import sparse as ks

    cfg, comp, batch, q = case["cfg"], case["comp"], case["batch"], case["q"]
    sc, scale = cfg.sparse, cfg.head_dim ** -0.5
    B, hkv = batch.num_seqs, cfg.num_key_value_heads
    table, count = ks.select_blocks_decode(q[:B], comp, LAYER, batch.page_table, batch.seq_lens, sc, scale,
                                           max_sel, bb=bb, prompt_lens=batch.prompt_lens)
    ar = torch.arange(B, device=q.device, dtype=torch.int32)
    keys = ks._stage1_keys(q[:B], comp, LAYER, batch.page_table, batch.seq_lens, (batch.seq_lens - 1).long(),
                           (ar, ar, torch.ones_like(ar)), B, 0, batch.page_table.shape[1], scale, 1, bb,
                           lse_per_split=ks._LSE_BLOCK_N,  # the partition select_blocks_decode uses
                           prompt_lens=batch.prompt_lens)
    kscores, _ = ks.unpack_keys(keys)
    stats = _new_stats()
    stats.update(layout_ok=(tuple(table.shape) == (B, hkv, max_sel) and table.dtype == torch.int32
                            and tuple(count.shape) == (B, hkv) and count.dtype == torch.int32),
                 dense_rows_ok=True, natural_differ=0, natural_scores_differ=0)
    table, count = table.cpu(), count.cpu()
    naturals = reference_block_scores(case, decode=True, natural=True) if any(batch.prompt_lens_host) else None
    for (i, sl, L), (bref, mref) in zip(_seq_slices(batch), reference_block_scores(case, decode=True)):
        if naturals is not None:
            stats["natural_differ"] += int((naturals[i][1] != mref).any(-1).sum())
            stats["natural_scores_differ"] += int((naturals[i][0] != bref).any(-1).sum())
        nb = bref.shape[-1]
        inv = {p: b for b, p in enumerate(batch.page_table[i, :nb].tolist())}  # page -> block
        mine = torch.zeros(hkv, 1, nb, dtype=torch.bool)
        for g in range(hkv):
            c = int(count[i, g])
            blocks = [inv.get(p, -1) for p in table[i, g, :c].tolist()]
            stats["layout_ok"] &= (c > 0 and -1 not in blocks and blocks == sorted(set(blocks))
                                   and blocks[-1] == nb - 1 and bool((table[i, g, c:] == 0).all()))
            mine[g, 0, [b for b in blocks if b >= 0]] = True
        mine = mine.to(q.device)
        if L >= sc.dense_len:
            _compare(stats, kscores[:, i:i + 1, :nb], mine, bref, mref,
                     torch.tensor([(L - 1) // sc.block_size], device=q.device), sc)
        else:
            stats["dense_rows_ok"] &= bool(mine.all())
    return stats


def check_decode_width_invariance(case: dict, max_sel: int, bb: int = 4, wide: int = 5) -> dict:
    """select_blocks_decode on the case's page table, on the same table `wide` times as wide (zero
    columns, as a CUDA graph's static table), and on that with one more row (a padded batch). Per
    variant: the same pages and counts, bit-equal keys over the real blocks, and lse partials equal
    to the tight table's, the extra ranges empty (max -inf, sum 0), so the lse merges to the same
    bits. (Sized to the GPU, the partition moved with the width and rows; on small interpreter
    cases that seldom flips a bf16 score, so the partials are compared directly.)"""
    from salaserve.kernels import sparse as ks

    cfg, comp, batch, q = case["cfg"], case["comp"], case["batch"], case["q"]
    sc, scale = cfg.sparse, cfg.head_dim ** -0.5
    B = batch.num_seqs
    table = batch.page_table
    wide_table = torch.nn.functional.pad(table, (0, (wide - 1) * table.shape[1] + 3))
    partials = []
    orig = ks._stage1_lse_partials

    def recording(*a, **k):
        partials.append(orig(*a, **k))
        return partials[-1]

    got = {}
    with _knobs(_stage1_lse_partials=recording):
        for name, t, qq, lens in (("tight", table, q[:B], batch.seq_lens),
                                  ("wide", wide_table, q[:B], batch.seq_lens),
                                  ("wide_padded_batch", torch.cat([wide_table, wide_table[:1]]),
                                   torch.cat([q[:B], q[:1]]), torch.cat([batch.seq_lens, batch.seq_lens[:1]]))):
            partials.clear()
            pages, count = ks.select_blocks_decode(qq, comp, LAYER, t, lens, sc, scale, max_sel, bb=bb)
            (m, l), = partials
            ar = torch.arange(t.shape[0], device=q.device, dtype=torch.int32)
            keys = ks._stage1_keys(qq, comp, LAYER, t, lens, (lens - 1).long(), (ar, ar, torch.ones_like(ar)),
                                   t.shape[0], 0, t.shape[1], scale, 1, bb, lse_per_split=ks._LSE_BLOCK_N)
            got[name] = (pages[:B], count[:B], keys[:, :B, :table.shape[1]], m[:, :, :B], l[:, :, :B])
    ref = got["tight"]
    n = ref[3].shape[0]
    out = {}
    for name, (p, c, k, m, l) in got.items():
        if name == "tight":
            continue
        out[name] = bool(torch.equal(p, ref[0]) and torch.equal(c, ref[1]) and torch.equal(k, ref[2])
                         and m.shape[0] >= n and torch.equal(m[:n], ref[3]) and torch.equal(l[:n], ref[4])
                         and bool((m[n:] == float("-inf")).all()) and bool((l[n:] == 0).all()))
    out["splits"] = n
    return out


def sparse_twin(q, kv, layer, batch, block_idx, scale):
    """Torch twin of sparse_prefill_attention: reference softmax attention restricted to the
    keys of each token's listed blocks that are <= its position."""
    out = torch.empty_like(q)
    bs = kv.block_size
    for i, sl, L in _seq_slices(batch):
        nb = -(-L // bs)
        keys, values = kv.gather(layer, batch.page_table[i, :nb], L)
        pos = batch.positions[sl]
        allowed = _mask_from_idx(block_idx[:, sl], nb).repeat_interleave(bs, -1)[..., :L]
        allowed &= (torch.arange(L, device=q.device)[None, :] <= pos[:, None])[None]
        out[sl] = spec.attention(q[sl], keys, values, allowed, scale)
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def check_attention(case: dict, shuffle: bool = False, block_t: int = 4, bb: int = 32,
                    window_tokens: int | None = None) -> dict:
    """sparse_prefill_attention against the torch twin on the kernel's own selection
    (shuffle=True: entries in random order, which the kernel must accept too); window_tokens: the
    window kernel (that many tokens per program) before the per-token one; None: the per-token
    kernel over every listed block."""
    from salaserve.kernels import sparse as ks

    cfg, kv, comp, batch, q = case["cfg"], case["kv"], case["comp"], case["batch"], case["q"]
    scale = cfg.head_dim ** -0.5
    idx = ks.select_blocks_prefill(q, comp, LAYER, batch, cfg.sparse, scale, block_t=block_t, bb=bb)
    if shuffle:  # random order of the valid entries, -1 kept at the end
        g = torch.Generator().manual_seed(1)
        key = torch.rand(idx.shape, generator=g).to(idx.device) + (idx < 0).float() * 2
        idx = torch.gather(idx, -1, key.argsort(-1))
    window = {} if window_tokens is None else dict(window=(cfg.sparse.init_blocks, cfg.sparse.local_blocks),
                                                   window_tokens=window_tokens)
    got = ks.sparse_prefill_attention(q, kv, LAYER, batch, idx, scale, **window)
    want = sparse_twin(q, kv, LAYER, batch, idx, scale)
    return dict(max_abs=float((got.float() - want.float()).abs().max()), rel=_rel_err(got, want),
                dtype_ok=got.dtype == q.dtype)


def check_full(case: dict, **select_kw) -> dict:
    """sparse_attention against TorchBackend.sparse_attention (selection + attention). Rows whose
    selection differs from the reference (rare bf16 rounding flips, see `_compare`) are counted;
    max_abs / rel compare the other rows, rel_all every row."""
    from salaserve.kernels import sparse as ks
    from salaserve.kernels.torch_ops import TorchBackend

    cfg, kv, comp, batch, q = case["cfg"], case["kv"], case["comp"], case["batch"], case["q"]
    got = ks.sparse_attention(q, kv, comp, LAYER, batch, cfg, **select_kw)
    want = TorchBackend().sparse_attention(q, kv, comp, LAYER, batch, cfg)
    idx = ks.select_blocks_prefill(q, comp, LAYER, batch, cfg.sparse, cfg.head_dim ** -0.5, **select_kw)
    same_sel = torch.ones(cfg.num_key_value_heads, batch.num_tokens, dtype=torch.bool, device=q.device)
    refs = reference_block_scores(case)
    for (i, sl, L), (_, mref) in zip(_seq_slices(batch), refs):
        if batch.is_sparse_host[i]:
            same_sel[:, sl] = (_mask_from_idx(idx[:, sl], mref.shape[-1]) == mref).all(-1)
    rows = same_sel.t().repeat_interleave(cfg.gqa_group_size, 1)  # [N, Hq]
    err = (got.float() - want.float()).abs()[rows]
    return dict(rows=rows.numel(), rows_differ=int((~rows).sum()), max_abs=float(err.max()) if err.numel() else 0.0,
                rel=_rel_err(got[rows], want[rows]), rel_all=_rel_err(got, want), dtype_ok=got.dtype == q.dtype)


# ---------------------------------------------------------------------------------------------
# The interpreter run (tiny config, fp32)
# ---------------------------------------------------------------------------------------------

def _knobs(**kw):
    """Temporarily set module-level knobs of salaserve.kernels.sparse (split sizes, functions), in
    whichever of its modules read them."""
    from salaserve.kernels import sparse as ks

    return ks.knobs(**kw)


def _part_select() -> dict:
    """Selection cases. Tiny config: block 16, C1 8/4, C2 32/16, dense_len 128, topk_eff 8.
    (cache_len, q_len) per sequence; block_t / bb (tokens per tile, blocks per step) vary so that
    tiles and steps end at different places; one program per tile unless a case asks for splits."""
    cfg = tiny_cfg()
    res = {}
    with _knobs(_TARGET_PROGRAMS=1):
        # one-shot prefill of a sparse prompt: every C1/C2 birth, partial last page (140 = 8*16 + 12)
        res["select_oneshot_struct"] = check_prefill_selection(
            make_case(cfg, [(0, 140)], seed=1), block_t=8, bb=4)
        res["select_oneshot_noise"] = check_prefill_selection(
            make_case(cfg, [(0, 140)], seed=2, structured=False), block_t=4, bb=8)
        # chunks on top of caches, starting mid-page and mid C1/C2 window, partial last pages
        chunked = [(131, 37), (250, 22), (127, 9)]
        res["select_chunked_struct"] = check_prefill_selection(make_case(cfg, chunked, seed=3), block_t=8, bb=4)
        res["select_chunked_noise"] = check_prefill_selection(
            make_case(cfg, chunked, seed=4, structured=False), block_t=2, bb=16)
        # a dense sequence (L < dense_len) in the batch: all its causal blocks listed, width grows
        res["select_mixed"] = check_prefill_selection(make_case(cfg, [(170, 21), (40, 50)], seed=5), block_t=8, bb=4)
        # every block ties (q = 0: equal stage-1 scores), so only the tie rule decides
        case = make_case(cfg, [(0, 200), (150, 30)], seed=6)
        case["q"] = torch.zeros_like(case["q"])
        res["select_all_ties"] = check_prefill_selection(case, block_t=8, bb=8)
        # 2 local blocks and 3 data-dependent ones: top-k and ties matter more
        res["select_small_topk"] = check_prefill_selection(
            make_case(tiny_cfg(topk=3, window_size=32), [(0, 150), (200, 40)], seed=7), block_t=8, bb=4)
    # long prompts, where most steps are interior (the unmasked path): full tiles and a ragged last
    # one, bb 4 and 8
    long_case = make_case(cfg, [(700, 13), (420, 8)], seed=14)
    res["select_long_interior"] = check_prefill_selection(long_case, block_t=4, bb=4)
    res["select_long_interior_t8_bb8"] = check_prefill_selection(long_case, block_t=8, bb=8)
    res["decode_long"] = check_decode_selection(
        make_case(cfg, [(130, 1), (255, 1), (1000, 1)], seed=15), max_sel=16, bb=4)
    # several programs per tile: split C2 (lse partials merged) and split block ranges
    with _knobs(_TARGET_PROGRAMS=64, _LSE_BLOCK_N=16):
        res["select_splits"] = check_prefill_selection(
            make_case(cfg, [(250, 22), (400, 9)], seed=8), block_t=8, bb=4)
    # decode: one query per sequence, dense ones (L < 128) get every block; several splits
    with _knobs(_TARGET_PROGRAMS=48, _LSE_BLOCK_N=16):
        dec = make_case(cfg, [(130, 1), (255, 1), (300, 1), (60, 1), (127, 1), (1000, 1)], seed=9)
        res["decode"] = check_decode_selection(dec, max_sel=16, bb=4)
        dec["q"] = torch.zeros_like(dec["q"])
        res["decode_all_ties"] = check_decode_selection(dec, max_sel=16, bb=8)
    # several splits that the old sizing would have placed differently per width and batch
    with _knobs(_TARGET_PROGRAMS=24, _LSE_BLOCK_N=16):
        res["decode_width_invariant"] = check_decode_width_invariance(
            make_case(cfg, [(300, 1), (1000, 1), (700, 1), (140, 1)], seed=17), max_sel=16)
    return res


def _part_attention() -> dict:
    """Attention cases (the interpreter's cost is per (token, KV head) program, so few tokens)."""
    cfg = tiny_cfg()
    res = {}
    with _knobs(_TARGET_PROGRAMS=1):
        sel = dict(block_t=8, bb=8)
        att = make_case(cfg, [(140, 20), (0, 30), (90, 10)], seed=10)
        res["attention"] = check_attention(att, **sel)
        res["attention_shuffled"] = check_attention(att, shuffle=True, **sel)
        # the window kernel: tiles of 4 (crossing the sequences' ends and 16-token blocks) and 8
        res["attention_window4"] = check_attention(att, window_tokens=4, **sel)
        res["attention_window8_shuffled"] = check_attention(att, shuffle=True, window_tokens=8, **sel)
        res["attention_window8"] = check_attention(att, window_tokens=8, **sel)
        with _knobs(SPARSE_WINDOW_TOKENS=4):  # through sparse_attention, dense sequence included
            res["full_mixed_window"] = check_full(make_case(cfg, [(150, 10), (40, 30)], seed=12), **sel)
        res["full_chunked"] = check_full(make_case(cfg, [(131, 20), (250, 7), (300, 3)], seed=11), **sel)
        res["full_mixed"] = check_full(make_case(cfg, [(150, 10), (40, 30)], seed=12), **sel)
        # one-shot sparse prefill at every position, with a config small enough to afford it:
        # dense_len 64, topk_eff 3 (1 local block)
        small = tiny_cfg(topk=2, window_size=16, dense_len=64)
        res["full_oneshot"] = check_full(make_case(small, [(0, 90)], seed=13), **sel)
    return res


def check_topk_pages(seed: int, sc=None, nb: int = 40, max_sel: int = 16, seq_lens=None,
                     device: str = "cpu", levels: int = 0) -> dict:
    """The fused top-k-to-pages kernel against the torch path on random packed keys: sparse rows,
    dense rows, rows shorter than top-k, -inf scored blocks, and +inf forced ones. Default: the
    tiny config (block 16, dense_len 128, topk_eff 8), 40 blocks. levels > 0: scores drawn from
    that many values only, so that many blocks tie at the top-k threshold score."""
    from salaserve.kernels import sparse as ks

    g = torch.Generator().manual_seed(seed)
    sc = sc or tiny_cfg().sparse
    seq_lens = torch.tensor(seq_lens or [640, 129, 60, 300, 17, 128], dtype=torch.int32)
    B, hkv = seq_lens.shape[0], 2
    if levels:
        scores = torch.randint(0, levels, (hkv, B, nb), generator=g).float() - levels / 2
    else:
        scores = torch.randn(hkv, B, nb, generator=g).to(torch.bfloat16).float()
    scores[:, :, :3] = float("inf")  # forced
    scores[:, 1, 4:6] = float("-inf")
    scores[0, 3, 10:14] = scores[0, 3, 9]  # equal scores: the lower block must win
    blk = torch.arange(nb)
    qb = (seq_lens.long() - 1) // sc.block_size
    scores[:, blk[None, :] > qb[:, None]] = float("-inf")  # future blocks, as stage 1 writes them
    keys = ks.pack_keys(scores)
    table = torch.randperm(max(1000, B * nb), generator=g)[: B * nb].view(B, nb).to(torch.int32) + 1
    keys, table, seq_lens = keys.to(device), table.to(device), seq_lens.to(device)
    ref_pages, ref_count = ks.topk_pages_torch(keys, table, seq_lens, sc, max_sel)
    pages, count = ks.topk_pages(keys, table, seq_lens, sc, max_sel)
    return {"equal": bool(torch.equal(pages, ref_pages) and torch.equal(count, ref_count)),
            "counts": ref_count.cpu().tolist()}


def stage1_like_keys(g: torch.Generator, hkv: int, qb: torch.Tensor, nb: int, dense: torch.Tensor, levels: int = 0,
                     init: int = 1, local: int = 2) -> torch.Tensor:
    """Packed keys [hkv, R, nb] as _stage1_block_keys_kernel's _store_keys writes them, on random
    block scores (levels > 0: that many values only): +inf for the init blocks (even past qb), the
    local window and every causal block of a dense row, -inf for the other future blocks."""
    from salaserve.kernels.sparse import pack_keys

    R = qb.shape[0]
    if levels:
        scores = torch.randint(0, levels, (hkv, R, nb), generator=g).float() - levels / 2
    else:
        scores = torch.randn(hkv, R, nb, generator=g).abs()  # pooled scores are sums of exps: >= 0
    blk, qb2 = torch.arange(nb)[None, :], qb[:, None]
    forced = (blk < init) | ((blk >= qb2 - local) & (blk <= qb2)) | (dense[:, None] & (blk <= qb2))
    scores = torch.where(forced, float("inf"), torch.where(blk > qb2, float("-inf"), scores))
    return pack_keys(scores)


def check_topk_blocks(seed: int, rows: int = 8, nb: int = 40, width: int = 8, limit="int", keys: str = "stage1",
                      levels: int = 0, device: str = "cpu", init: int = 1,
                      sparse_limit: int | None = None) -> dict:
    """The fused prefill top-k (topk_blocks) against _topk_blocks on random packed keys [2, rows, nb]:
    equal output, bit for bit. limit: "int" (width: every row sparse), an int (below width), or
    "rows", a tensor: width for dense rows, sparse_limit (default width - 3) for the others, and
    with random keys a row each of limit 0 and 1. keys: "stage1" (stage1_like_keys, dense rows
    forced as their limit says; init > 1 forces future init blocks of the rows with small qb) or
    "random" (pack_keys of any scores: non-causal keys outrank causal ones, which _topk_blocks
    drops, so rows list fewer than min(limit, qb + 1) blocks; `short` counts those rows). qb: each
    row's last causal block, random but for rows at 0, 1, 2 and nb - 1."""
    from salaserve.kernels import sparse as ks

    g = torch.Generator().manual_seed(seed)
    qb = torch.randint(0, nb, (rows,), generator=g)
    qb[:4] = torch.tensor([0, 1, 2, nb - 1])[:rows]
    dense = torch.rand(rows, generator=g) < 0.3
    dense[3] = True  # (with limit="rows") the widest row: more causal blocks than width
    if limit == "rows":
        lim = torch.where(dense, width, sparse_limit or max(width - 3, 1))
        if keys == "random":
            lim[1], lim[2] = 0, 1
    else:
        lim = width if limit == "int" else int(limit)
    if keys == "stage1":
        k = stage1_like_keys(g, 2, qb, nb, dense if limit == "rows" else torch.zeros_like(dense), levels, init)
    elif levels:
        k = ks.pack_keys(torch.randint(0, levels, (2, rows, nb), generator=g).float())
    else:
        k = ks.pack_keys(torch.randn(2, rows, nb, generator=g))
    k, qb = k.to(device), qb.to(device)
    lim = lim.to(device) if isinstance(lim, torch.Tensor) else lim
    want = ks._topk_blocks(k, width, lim, qb)
    got = ks.topk_blocks(k, width, lim, qb)
    count = (want >= 0).sum(-1)
    full = torch.minimum(torch.as_tensor(lim, device=device).expand(rows), torch.clamp(qb + 1, max=nb)).clamp(min=0)
    return {"equal": bool(torch.equal(got, want)), "short": int((count < full[None]).sum()),
            "counts": sorted(set(count.flatten().tolist()))}


def _torch_topk_blocks(keys, width, limit, qb, out=None):
    """topk_blocks' contract through the torch function it matches (_topk_blocks)."""
    from salaserve.kernels import sparse as ks

    want = ks._topk_blocks(keys, width, limit, qb)
    return want if out is None else out.copy_(want)


def check_prefill_topk_fused_vs_torch(case: dict, block_t: int = 8, bb: int = 4) -> dict:
    """select_blocks_prefill with the fused top-k (topk_blocks) and with the torch function in its
    place (_torch_topk_blocks): the same block indices, and both used (calls counted)."""
    from salaserve.kernels import sparse as ks

    cfg, comp, batch, q = case["cfg"], case["comp"], case["batch"], case["q"]
    calls = {"fused": 0, "torch": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    out = {}
    for name, fn in (("fused", ks.topk_blocks), ("torch", _torch_topk_blocks)):
        with _knobs(topk_blocks=counting(name, fn)):
            out[name] = ks.select_blocks_prefill(q, comp, LAYER, batch, cfg.sparse, cfg.head_dim ** -0.5,
                                                 block_t=block_t, bb=bb)
    return {"equal": bool(torch.equal(out["fused"], out["torch"])), "width": out["fused"].shape[-1], **calls}


def check_overflow(cfg: ModelConfig, seed: int, block_t: int = 8, bb: int = 4) -> dict:
    """D4: one sequence of 200 tokens whose C1 entry 9 (block 2, pooled into no other block) is a
    spike along the queries' shared direction, so that for every query exp(s*q.C1 - lse) overflows
    fp32 while the C2 entries (left as they are) keep lse small. check_prefill_selection's stats
    (the kernel against the reference, +inf == +inf), plus: inf_rows, the (group, token) rows that
    see the entry and whose kernel block-2 score is +inf, of `eligible`; chosen_rows, of those
    with block 2 not forced (qb > 2 + local_blocks), the rows whose kernel selection has it."""
    from salaserve.kernels import sparse as ks

    case = make_case(cfg, [(0, 200)], seed=seed)
    comp, batch, q = case["comp"], case["batch"], case["q"]
    sc = cfg.sparse
    page = int(batch.page_table[0, 2])
    comp.c1[LAYER, page, 1] = 0.0
    comp.c1[LAYER, page, 1, :, 0] = 60.0  # entry 9 = page 2's slot 1 (4 entries per 16-token page)
    q[:, :, 0] += 10.0  # s * q.C1 ~ 0.25 * 10 * 60 = 150 > 88.7 + lse
    stats = check_prefill_selection(case, block_t=block_t, bb=bb)
    nb = -(-200 // sc.block_size)
    tiles = ks.tile_tensors(ks._prefill_tiles(batch, block_t), q.device)
    keys = ks._stage1_keys(q, comp, LAYER, batch.page_table, batch.seq_lens, batch.positions, tiles,
                           batch.num_tokens, 0, nb, cfg.head_dim ** -0.5, block_t, bb)
    kscores, _ = ks.unpack_keys(keys)
    pos = batch.positions
    sees = pos >= 9 * sc.kernel_stride + sc.kernel_size - 1  # entry 9's window ends at 43
    idx = ks.select_blocks_prefill(q, comp, LAYER, batch, sc, cfg.head_dim ** -0.5, block_t=block_t, bb=bb)
    free = pos // sc.block_size > 2 + sc.local_blocks
    stats.update(eligible=int(sees.sum()) * kscores.shape[0],
                 inf_rows=int((kscores[:, sees, 2] == float("inf")).sum()),
                 free_rows=int(free.sum()) * kscores.shape[0],
                 chosen_rows=int((idx[:, free] == 2).any(-1).sum()))
    return stats


def _part_prompt() -> dict:
    """Stage-1 prompt rule (D1) and overflow (D4) cases. Tiny config: C1 stride 4, C2 stride 16,
    so prompts of 15 (mod 16) tokens hide the newest C2 entry from their prompt tokens and
    3 (mod 4) the newest C1 entry. (cache_len, q_len, prompt_len) per sequence."""
    cfg = tiny_cfg()
    res = {}
    with _knobs(_TARGET_PROGRAMS=1):
        # one-shot prompts at the C2 residue (143, 207) and a C1-only one (147)
        res["prompt_oneshot"] = check_prefill_selection(
            make_case(cfg, [(0, 143, 143), (0, 207, 207), (0, 147, 147)], seed=21), block_t=8, bb=4)
        # chunks: ending at the prompt's end; inside a prompt, mid-page; one that crosses the prompt's
        # end (a recompute: prompt tokens, then output tokens by the decode rule); a prompt of no lag
        res["prompt_chunked"] = check_prefill_selection(
            make_case(cfg, [(131, 12, 143), (250, 13, 271), (190, 20, 207), (127, 9, 136)], seed=22),
            block_t=4, bb=8)
        res["prompt_overflow"] = check_overflow(cfg, seed=23)
        # selection + attention against TorchBackend.sparse_attention (which reads the host prompt lengths)
        res["prompt_full"] = check_full(make_case(cfg, [(131, 12, 143), (190, 20, 207)], seed=25), block_t=8, bb=8)
    # one-token rows: a prompt's last token alone in a step (prompt rule), decode rows (no lag)
    with _knobs(_TARGET_PROGRAMS=48, _LSE_BLOCK_N=16):
        rows = [(L - 1, 1, L) for L in range(143, 400, 32)] + [(300, 1, 143), (150, 1, 151), (146, 1, 147)]
        res["prompt_decode"] = check_decode_selection(make_case(cfg, rows, seed=24), max_sel=16, bb=4)
    return res


def _part_topk() -> dict:
    res = {f"topk_pages_{s}": check_topk_pages(s) for s in range(3)}
    # 3 score levels over 40 blocks: the threshold score is shared by many blocks in most rows
    res["topk_pages_ties"] = check_topk_pages(7, levels=3)
    with _knobs(TOPK_ONE_PASS_BLOCKS=16, TOPK_SEGMENT=16):  # 40 blocks: 3 segments (+1 empty) and a merge
        res.update({f"topk_pages_segmented_{s}": check_topk_pages(s) for s in range(2)})
        res["topk_pages_segmented_ties"] = check_topk_pages(8, levels=3)
    return res


TOPK_BLOCKS_CASES = {  # name: check_topk_blocks arguments (8 rows, 2 KV heads, 40 blocks, width 8)
    "stage1": dict(seed=0),  # every row sparse: int limit = width < nb
    "stage1_rows_ties": dict(seed=1, limit="rows", levels=3),  # dense rows mixed in; 3 score values
    "stage1_narrow_init3": dict(seed=2, limit="rows", nb=6, init=3),  # nb < width; forced future init blocks
    "random_rows": dict(seed=3, keys="random", limit="rows"),  # limits 0 and 1 too; short rows
    "random_limit3_ties": dict(seed=4, keys="random", limit=3, levels=3),  # int limit < width
    "random_limit1": dict(seed=5, keys="random", limit=1),
}
TOPK_BLOCKS_SEGMENTED = {  # TOPK_ONE_PASS_BLOCKS = TOPK_SEGMENT = 16: 40 blocks in 3 segments (+1 empty)
    "segmented_stage1_rows": dict(seed=6, rows=6, limit="rows"),
    "segmented_random_ties": dict(seed=7, rows=6, keys="random", limit="rows", levels=3),
}


def _part_topk_blocks() -> dict:
    """The fused prefill top-k: topk_blocks against _topk_blocks, one pass and segmented;
    select_blocks_prefill with the fused top-k and with the torch function in its place."""
    res = {}
    for cases, knobs in ((TOPK_BLOCKS_CASES, {}), (TOPK_BLOCKS_SEGMENTED, dict(TOPK_ONE_PASS_BLOCKS=16,
                                                                               TOPK_SEGMENT=16))):
        with _knobs(**knobs):
            res.update({f"blocks_{n}": check_topk_blocks(**kw) for n, kw in cases.items()})
    cfg = tiny_cfg()
    with _knobs(_TARGET_PROGRAMS=1):
        with _knobs(_SELECT_BUFFER_BYTES=1):  # a chunk per tile: topk_blocks writes into slices of the output
            res["fused_sparse_chunks"] = check_prefill_topk_fused_vs_torch(make_case(cfg, [(250, 9), (131, 5)], seed=18))
        # a dense sequence mixed in: the per-row limit; all dense: nb (2) < width (8)
        res["fused_mixed"] = check_prefill_topk_fused_vs_torch(make_case(cfg, [(170, 6), (40, 10)], seed=19))
        res["fused_dense_narrow"] = check_prefill_topk_fused_vs_torch(make_case(cfg, [(10, 20)], seed=20))
    return res


def _torch_prefill_topk(part):
    """`part` with the torch function in the place of select_blocks_prefill's fused top-k: the
    interpreter runs topk_blocks at ~12 ms per (row, KV head) program, which added ~45 s to the
    select and attention parts. The topk_blocks part shows both equal; the GPU tests select with
    the fused one."""
    def run():
        with _knobs(topk_blocks=_torch_topk_blocks):
            return part()
    return run


PARTS = {"select": _torch_prefill_topk(_part_select), "attention": _torch_prefill_topk(_part_attention),
         "topk": _part_topk, "topk_blocks": _part_topk_blocks, "prompt": _torch_prefill_topk(_part_prompt)}

if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(PARTS[sys.argv[1]]()))
    sys.stdout.flush()
