"""Block-sparse prefill attention over the selected blocks of the paged KV cache (Triton):
the per-token kernel, the window kernel for the forced blocks, and the tile kernel."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import FP8_STAGE_MAX_BYTES, KVPool
from salaserve.config import ModelConfig
from salaserve.engine.batch import ForwardBatch
from salaserve.kernels._triton_utils import tl_dtype
from salaserve.kernels.attention import _dot_q, _f16_dots, _load_kv, _pool_args, dequantize_pages
from salaserve.kernels.sparse._common import (LOG2E, _dot_precision, _launch_env, _load_q_rows, _pow2, _step_tiles,
                                              _tile_rows)
from salaserve.kernels.sparse.selection import select_blocks_prefill

# Launches of the per-token kernel and the window kernel (warps by their tile unless set).
# Measured on the last 8K chunk of a 128K prompt (run 53, scripts/sparse_launch_ab.py): the window
# kernel capped at 128 registers (two programs per SM; 120-128 bytes of stack): window + per-token
# attention 5.83 -> 5.48 ms. The per-token kernel did not gain from a cap (96: 5.78 vs 5.75 ms)
# or from 8 warps (7.69), so it keeps its defaults. Run 57: per-token kernel with pages from a
# list (SPARSE_ATTN_PAGE_LIST): window + per-token 5466 -> 5363 us, and **with 2 warps 5203**
# (the 2-warp kernel alone: 5384); window kernel at 2 stages 5419 -> 5332. The per-token kernel's
# warps default by the pool's dtype (`_PER_TOKEN_WARPS`); SALASERVE_SPARSE_ATTN_LAUNCH overrides them.
SPARSE_ATTN_LAUNCH = _launch_env("SALASERVE_SPARSE_ATTN_LAUNCH", "0,0,0")
SPARSE_WINDOW_LAUNCH = _launch_env("SALASERVE_SPARSE_WINDOW_LAUNCH", "0,2,128")


@triton.jit
def _softmax_block(q, k_ptrs, v_ptrs, visible, scale_off, k_scale_ptr, v_scale_ptr, m, l, acc, scale2,
                   KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, DOT_PREC: tl.constexpr,
                   F16_DOTS: tl.constexpr = False):
    """One K/V block of the online softmax (base 2) of the rows q: scores outside `visible`
    [rows, BS] are -inf; fp8 pages take their (page, KV head) scales at scale_off on the scores and
    on the probabilities. A row that sees nothing in this block keeps (m, l, acc) exactly; one
    that has seen nothing yet keeps m = -inf, l = 0, acc = 0. Returns the new (m, l, acc).
    F16_DOTS (fp8 pages, q from _dot_q): the codes go to fp16 operands (one convert per two codes; to
    bf16 it is that plus a convert per code and repacking), p stays in [0, 1] as the fp16 operand of
    p @ v and the V scale goes on the fp32 product, as attention.DECODE_FP8_F16_DOTS."""
    k = _load_kv(k_ptrs, KV_FP8, tl.float16 if F16_DOTS else COMPUTE_DT)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale2
    if KV_FP8:
        s = s * tl.load(k_scale_ptr + scale_off)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = _load_kv(v_ptrs, KV_FP8, tl.float16 if F16_DOTS else COMPUTE_DT)
    if F16_DOTS:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v, input_precision=DOT_PREC) * tl.load(
            v_scale_ptr + scale_off)
    else:
        if KV_FP8:
            p = p * tl.load(v_scale_ptr + scale_off)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l, acc


@triton.jit
def _selected_block(q, b, page, pos, g, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, stride_kp, stride_ks, stride_kh, m, l,
                    acc, scale2, D: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr,
                    DOT_PREC: tl.constexpr, HKV: tl.constexpr, F16_DOTS: tl.constexpr):
    """Block b (in page `page`) of a sequence in one token's online softmax."""
    d = tl.arange(0, D)
    s_off = tl.arange(0, BS)
    page = page.to(tl.int64)  # pools exceed 2^31 elements
    kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
    # every selected block is <= the query's block, so each has a visible key: m stays finite
    return _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, (b * BS + s_off)[None, :] <= pos, page * HKV + g,
                          k_scale_ptr, v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC, F16_DOTS)


@triton.jit
def _sparse_prefill_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_idx_ptr, page_table_ptr, tok_seq_ptr, positions_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
    stride_bg, stride_bt, stride_pt,
    scale2,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, W: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
    m_part_ptr=None, l_part_ptr=None, acc_part_ptr=None,
    AFTER_WINDOW: tl.constexpr = False, INIT: tl.constexpr = 1, LOCAL: tl.constexpr = 32,
    page_idx_ptr=None, PAGE_LIST: tl.constexpr = False,
    F16_DOTS: tl.constexpr = False,  # fp8 pages: fp16 dot operands (_softmax_block; SPARSE_FP8_F16_DOTS)
):
    """One program per (token, KV head g): the group's query heads are the M dimension of tl.dot
    (padded to GP >= 16), iterating over the token's selected blocks (pages through the page
    table). Causal mask inside the current block; fp32 online softmax (base 2).
    AFTER_WINDOW: the forced blocks (init, local window) were done by _sparse_window_attn_kernel;
    start from its softmax state ([N, Hq] m and l, [N, Hq, D] acc) and skip them here.
    PAGE_LIST: page_idx_ptr holds each entry's page (block_idx's layout), so the loop loads the page
    and then its K/V: two dependent loads instead of three, and fewer registers."""
    tok, g = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tok_seq_ptr + tok)
    pos = tl.load(positions_ptr + tok)
    h = tl.arange(0, GP)
    h_ok = h < GROUP
    d = tl.arange(0, D)
    q = _dot_q(tl.load(q_ptr + tok * stride_qt + (g * GROUP + h)[:, None] * stride_qh + d[None, :],
                       mask=h_ok[:, None], other=0.0), F16_DOTS)

    row = block_idx_ptr + g * stride_bg + tok * stride_bt
    blocks = tl.load(row + tl.arange(0, W))
    if AFTER_WINDOW:
        # the window kernel did the forced blocks; in an ascending list the others (INIT <= b <
        # qb - LOCAL) are one run of entries, so the loop below has no branch in it (a skip test
        # per entry measured slower than walking all 96)
        hq = tok * (HKV * GROUP) + g * GROUP + h  # the partials are contiguous [N, Hq(, D)]
        m = tl.load(m_part_ptr + hq, mask=h_ok, other=float("-inf"))
        l = tl.load(l_part_ptr + hq, mask=h_ok, other=0.0)
        acc = tl.load(acc_part_ptr + hq[:, None] * D + d[None, :], mask=h_ok[:, None], other=0.0)
        first = tl.sum(((blocks >= 0) & (blocks < INIT)).to(tl.int32), axis=0)
        end = first + tl.sum(((blocks >= INIT) & (blocks < pos // BS - LOCAL)).to(tl.int32), axis=0)
    else:
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        first = 0
        end = tl.sum((blocks >= 0).to(tl.int32), axis=0)  # valid entries come first
    for i in range(first, end):
        b = tl.load(row + i)
        if PAGE_LIST:
            page = tl.load(page_idx_ptr + g * stride_bg + tok * stride_bt + i)
        else:
            page = tl.load(page_table_ptr + seq * stride_pt + b)
        m, l, acc = _selected_block(q, b, page, pos, g, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, stride_kp,
                                    stride_ks, stride_kh, m, l, acc, scale2, D, BS, KV_FP8, COMPUTE_DT, DOT_PREC, HKV,
                                    F16_DOTS)
    o = acc / l[:, None]
    tl.store(o_ptr + tok * stride_ot + (g * GROUP + h)[:, None] * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _attention_tile(q_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, g, stride_qt, stride_qh,
                    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """The rows of tile program_id(0) for KV head g (see _tile_rows), which of them are real
    tokens and real heads, and their queries."""
    seq, tok0, ntok, t_of_r, h_of_r, tok_r, pos_r = _tile_rows(
        tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, tl.program_id(0), GP, BLOCK_T)
    tok_ok = t_of_r < ntok
    row_ok = tok_ok & (h_of_r < GROUP)
    q = _load_q_rows(q_ptr, tok_r, h_of_r, row_ok, g, stride_qt, stride_qh, GROUP, D)
    return seq, h_of_r, tok_r, pos_r, tok_ok, row_ok, q


@triton.jit
def _sparse_window_attn_kernel(
    q_ptr, k_ptr, v_ptr, m_part_ptr, l_part_ptr, acc_part_ptr, page_table_ptr, positions_ptr,
    tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_pt,
    scale2,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr,
    INIT: tl.constexpr, LOCAL: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
):
    """The blocks every token selects whatever its scores: the init blocks and the local window
    (blocks qb - LOCAL .. qb of a token in block qb). Consecutive tokens share them, so one
    program per (tile of BLOCK_T consecutive tokens of one sequence, KV head g) reads each such
    block's K/V once for all its (token, head) rows. Walks the init blocks, then the union of the
    tile's windows; a row takes a block only if it is forced for its token, and only its causal
    keys. Writes the unnormalised softmax state (base 2) per row for the per-token kernel to
    continue over the other selected blocks (AFTER_WINDOW)."""
    g = tl.program_id(1)
    seq, h_of_r, tok_r, pos_r, tok_ok, row_ok, q = _attention_tile(
        q_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, g, stride_qt, stride_qh, GROUP, GP, D,
        BLOCK_T)
    d = tl.arange(0, D)
    s_off = tl.arange(0, BS)
    qb_r = pos_r // BS
    qb_lo = tl.min(tl.where(tok_ok, qb_r, 1 << 30), axis=0)
    qb_hi = tl.max(tl.where(tok_ok, qb_r, -1), axis=0)

    m = tl.full([BLOCK_T * GP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T * GP], tl.float32)
    acc = tl.zeros([BLOCK_T * GP, D], tl.float32)
    # init blocks (forced for every token; causality alone limits them), then the windows from
    # where they start (never below INIT: no block twice)
    for b in range(0, INIT):
        page = tl.load(page_table_ptr + seq * stride_pt + b, mask=b <= qb_hi, other=0).to(tl.int64)
        kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
        visible = tok_ok[:, None] & ((b * BS + s_off)[None, :] <= pos_r[:, None])
        if b <= qb_hi:
            m, l, acc = _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, visible, page * HKV + g, k_scale_ptr,
                                       v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)
    for b in range(tl.maximum(qb_lo - LOCAL, INIT), qb_hi + 1):
        page = tl.load(page_table_ptr + seq * stride_pt + b).to(tl.int64)  # pools exceed 2^31 elements
        kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
        forced = tok_ok & (b >= qb_r - LOCAL)
        visible = forced[:, None] & ((b * BS + s_off)[None, :] <= pos_r[:, None])
        m, l, acc = _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, visible, page * HKV + g, k_scale_ptr,
                                   v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)
    hq = tok_r * (HKV * GROUP) + g * GROUP + h_of_r
    tl.store(m_part_ptr + hq, m, mask=row_ok)
    tl.store(l_part_ptr + hq, l, mask=row_ok)
    tl.store(acc_part_ptr + hq[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _sparse_prefill_attn_tile_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_idx_ptr, page_table_ptr, positions_ptr,
    tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
    stride_bg, stride_bt, stride_pt,
    scale2, W,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
):
    """One program per (tile of BLOCK_T consecutive tokens of one sequence, KV head g): the rows
    of tl.dot are (token, head-in-group) pairs, and the program walks the union of the tokens'
    selected blocks in ascending order, reading each block's K/V once for the whole tile. Every
    token's list must be ascending (valid entries first, -1 after). Each row keeps a cursor into
    its token's list; a step takes the smallest current block, and rows whose token did not
    select it are masked out of the scores, which leaves their softmax state bit for bit as it
    was. Per row the arithmetic is the per-token kernel's over the same blocks in the same order.
    """
    g = tl.program_id(1)
    seq, h_of_r, tok_r, pos_r, tok_ok, row_ok, q = _attention_tile(
        q_ptr, tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, g, stride_qt, stride_qh, GROUP, GP, D,
        BLOCK_T)
    d = tl.arange(0, D)
    s_off = tl.arange(0, BS)

    NONE: tl.constexpr = 1 << 30  # cursor past the end of a list
    lists = block_idx_ptr + g * stride_bg + tok_r * stride_bt  # [rows]: the row's token's list
    at = tl.zeros([BLOCK_T * GP], tl.int32)
    cur = tl.load(lists, mask=tok_ok, other=-1)
    cur = tl.where(cur < 0, NONE, cur)
    b = tl.min(cur, axis=0)

    m = tl.full([BLOCK_T * GP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T * GP], tl.float32)
    acc = tl.zeros([BLOCK_T * GP, D], tl.float32)
    while b < NONE:
        active = cur == b
        page = tl.load(page_table_ptr + seq * stride_pt + b).to(tl.int64)  # pools exceed 2^31 elements
        kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
        visible = active[:, None] & ((b * BS + s_off)[None, :] <= pos_r[:, None])
        m, l, acc = _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, visible, page * HKV + g, k_scale_ptr,
                                   v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)
        # the rows that took this block move to their next entry
        at = at + active.to(tl.int32)
        nxt = tl.load(lists + at, mask=tok_ok & active & (at < W), other=-1)
        cur = tl.where(active, tl.where(nxt < 0, NONE, nxt), cur)
        b = tl.min(cur, axis=0)
    o = acc / l[:, None]
    tl.store(o_ptr + tok_r[:, None] * stride_ot + (g * GROUP + h_of_r)[:, None] * stride_oh + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


# Tokens per program of the tile kernel (0: the per-token kernel). The tile kernel reads a block's
# K/V once per tile instead of once per token, but walks the union of the tile's lists: on dummy
# weights (adjacent tokens select unrelated blocks) tile 4 measured 1.5x slower (run 18), so it
# is off; real weights, whose neighbours share most blocks, may differ (perf notes).
SPARSE_ATTN_TILE = int(os.environ.get("SALASERVE_SPARSE_ATTN_TILE", "0"))
# Tokens per program of the window kernel (0: off). With it, the init and local-window blocks (34
# of a token's 96 at the real config) are read once per tile of consecutive tokens, which share
# them exactly, and the per-token kernel walks only the scored ones. bench_sparse (run 26, us
# per call): an 8K chunk at 128K 6795 -> 6250 (window 8) / 6446 (4); a 2K chunk at 18K 2025 ->
# 2042 / 2238. The whole 128K prefill moved less than micro's run-to-run spread (~0.2 s).
SPARSE_ATTN_WINDOW = int(os.environ.get("SALASERVE_SPARSE_ATTN_WINDOW", "8"))
# The per-token kernel reads each entry's page from a list made beforehand (one indexing of the
# page table in torch) instead of looking it up in its loop: two dependent loads per block instead
# of three. The sm_90 compile still has one K/V stage, but 82 registers instead of 128 at 4 warps;
# measured -2% at 4 warps, -5% at 2 (run 57, above).
SPARSE_ATTN_PAGE_LIST = os.environ.get("SALASERVE_SPARSE_ATTN_PAGE_LIST", "1") == "1"
# Warps of the per-token kernel by whether the pages are fp8: 2 for bf16 pages (run 57, above);
# 4 for fp8 ones, which spill at 2 (sm_90 compile: 255 registers, 48 bytes of stack).
_PER_TOKEN_WARPS = {False: 2, True: 4}
# fp8 pages with bf16 compute: the per-token kernel's dots take fp16 operands (_softmax_block), as the decode
# attention does (attention.DECODE_FP8_F16_DOTS). sm_90 compile at 4 warps: 2400 PTX lines against 2996, no bf16
# converts, but 168 registers against 128 (3 programs per SM instead of 4). Not in the window kernel, whose
# 128-register cap then spills more (304 bytes of stack against 136). Measured in a 32K prefill (BENCHMARKS run
# 151): the kernel 225.5 -> 215.4 ms, against 124.0 on bf16 pages; off. With SPARSE_FP8_STAGED (below) the
# per-token kernel reads fp8 pages only when the staged copy is off or over its size cap.
SPARSE_FP8_F16_DOTS = os.environ.get("SALASERVE_SPARSE_FP8_F16_DOTS", "0") == "1"
# fp8 pages: dequantize the prefill batch's pages of the layer once (attention.dequantize_pages, KVPool.gather's
# values) and run the bf16-page kernels on that copy. The per-token kernel reads each page once for every query
# token that selects it, so in-kernel the e4m3 converts repeat for each of those reads. Measured in a 32K prefill
# (BENCHMARKS run 152): the per-token kernel 220.8 -> 124.7 ms (bf16 pages: 123.7), the window kernel 43.5 ->
# 28.4 (28.1), the dequantize kernels 0.3 ms, the prefill's kernels 1.171 -> 1.101 s (bf16 pages: 1.082). The
# copy is transient, one layer at a time: 2 * Hkv * d * 2 bytes per token of the batch's sequences (1 KiB at
# full size), at most SPARSE_FP8_STAGE_MAX_BYTES; longer batches keep the in-kernel path.
SPARSE_FP8_STAGED = os.environ.get("SALASERVE_SPARSE_FP8_STAGED", "1") == "1"
SPARSE_FP8_STAGE_MAX_BYTES = FP8_STAGE_MAX_BYTES  # kept free by the cache budget (cache/budget.py)


def _ascending_lists(block_idx: torch.Tensor) -> torch.Tensor:
    """block_idx rows sorted ascending with the -1 padding kept at the end."""
    big = torch.iinfo(block_idx.dtype).max
    key = torch.where(block_idx < 0, big, block_idx).sort(dim=-1).values
    return torch.where(key == big, -1, key)


def _staged_table(batch: ForwardBatch, block_size: int):
    """The batch's pages in staging order and a page table [B, width] onto that order, built once per step
    (every sparse layer of a step stages the same pages; kept in batch.derived). Sequence i's pages
    0 .. ceil(len / block_size) come in order after sequence i - 1's; the table's columns past them read
    copy page 0 (never used). Returns (pages [P] on the device, table int32 on the device)."""
    cache = batch.derived if batch.derived is not None else {}
    key = ("fp8_staged_table", block_size)
    if key not in cache:
        n = torch.tensor([-(-int(L) // block_size) for L in batch.seq_lens_host], dtype=torch.int64)
        col = torch.arange(batch.page_table.shape[1])
        used = col[None, :] < n[:, None]
        table = torch.where(used, (n.cumsum(0) - n)[:, None] + col[None, :], 0)
        rows, cols = used.nonzero(as_tuple=True)  # row-major: the copy's order
        dev = batch.page_table.device
        cache[key] = batch.page_table[rows.to(dev), cols.to(dev)], table.to(device=dev, dtype=torch.int32)
    return cache[key]


def _staged_pages(kv: KVPool, layer: int, batch: ForwardBatch):
    """The batch's pages of `layer` dequantized into a fresh compute-dtype copy (see SPARSE_FP8_STAGED):
    (K, V [P, block_size, Hkv, d], a page table into them (_staged_table), the pool arguments of a plain
    pool), or None when the copy would exceed SPARSE_FP8_STAGE_MAX_BYTES."""
    _, bs, hkv, d = kv.k[layer].shape
    pages, table = _staged_table(batch, bs)  # once per step; its page count sizes the copy
    if 2 * pages.numel() * bs * hkv * d * kv.compute_dtype.itemsize > SPARSE_FP8_STAGE_MAX_BYTES:
        return None
    k, v = dequantize_pages(kv, layer, pages)
    return k, v, table, dict(k_scale=k, v_scale=v, fp8=False, compute=k.dtype)


def sparse_prefill_attention(q: torch.Tensor, kv: KVPool, layer: int, batch: ForwardBatch,
                             block_idx: torch.Tensor, scale: float, tile_tokens: int | None = None,
                             window: tuple[int, int] | None = None, window_tokens: int | None = None,
                             ascending: bool = False) -> torch.Tensor:
    """q [N, Hq, d]; block_idx [Hkv, N, W] int32 (ascending or not, valid entries first, -1 after).
    Each query attends to the keys of its selected blocks that are <= its position. Returns
    [N, Hq, d] in q.dtype. tile_tokens (default SPARSE_ATTN_TILE, a power of two): > 0 runs the
    tile kernel with that many consecutive tokens per program, 0 the per-token kernel (grid
    (N, Hkv), graph-safe in itself; the callers are not).
    window = (init_blocks, local_blocks): with the per-token kernel and window_tokens (default
    SPARSE_ATTN_WINDOW, a power of two) > 0, the forced blocks (b < init_blocks, or qb - local_blocks
    <= b <= qb for a token in block qb) go through the window kernel, window_tokens tokens per
    program. Every token's list must then hold all of its forced blocks, as InfLLM-v2's selection
    does (they score +inf); lists not known to be ascending (`ascending`) are sorted first."""
    tile = SPARSE_ATTN_TILE if tile_tokens is None else tile_tokens
    if tile < 0 or tile & (tile - 1):
        raise ValueError(f"tile_tokens must be 0 or a power of two, got {tile}")
    win = SPARSE_ATTN_WINDOW if window_tokens is None else window_tokens
    if win < 0 or win & (win - 1):
        raise ValueError(f"window_tokens must be 0 or a power of two, got {win}")
    N, Hq, D = q.shape
    hkv = kv.k.shape[3]
    group = Hq // hkv
    gp = max(16, _pow2(group))
    k, v = kv.k[layer], kv.v[layer]  # [pages, block_size, Hkv, D]
    pa = _pool_args(kv, layer)
    if pa["compute"] != q.dtype:
        raise ValueError(f"q is {q.dtype} but the KV cache computes in {pa['compute']}")
    out = torch.empty(N, Hq, D, dtype=q.dtype, device=q.device)
    if N == 0:
        return out
    page_table = batch.page_table
    staged = _staged_pages(kv, layer, batch) if pa["fp8"] and SPARSE_FP8_STAGED else None
    if staged is not None:  # the plain-pool kernels on a dequantized copy of the batch's pages
        k, v, page_table, pa = staged
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2))
    consts = dict(GROUP=group, GP=gp, D=D, BS=kv.block_size, DOT_PREC=_dot_precision(q.dtype), KV_FP8=pa["fp8"],
                  COMPUTE_DT=tl_dtype(pa["compute"]), HKV=hkv)
    if tile:
        block_idx = _ascending_lists(block_idx).contiguous()
        _, (tile_seq, tile_tok0, tile_ntok) = _step_tiles(batch, tile, q.device)
        _sparse_prefill_attn_tile_kernel[(tile_seq.numel(), hkv)](
            q, k, v, out, block_idx, page_table, batch.positions, tile_seq, tile_tok0, tile_ntok,
            pa["k_scale"], pa["v_scale"], *strides, block_idx.stride(0), block_idx.stride(1),
            page_table.stride(0), scale * LOG2E, block_idx.shape[-1],
            BLOCK_T=tile, num_warps=4 if tile * gp <= 64 else 8, **consts)
        return out
    width = block_idx.shape[-1]
    if width & (width - 1):  # the kernel reads a power-of-two row to count valid entries
        block_idx = torch.nn.functional.pad(block_idx, (0, _pow2(width) - width), value=-1)
    block_idx = block_idx.contiguous()
    tok_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=q.device),
                                      batch.cu_seqlens_q.diff(), output_size=N)
    kernel_kw = {}  # the per-token kernel's optional inputs (window state, page list)
    if window is not None and win:
        init, local = window
        if not ascending:
            block_idx = _ascending_lists(block_idx)
        m_part = torch.empty(N, Hq, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(N, Hq, D, dtype=torch.float32, device=q.device)
        _, (tile_seq, tile_tok0, tile_ntok) = _step_tiles(batch, win, q.device)
        _sparse_window_attn_kernel[(tile_seq.numel(), hkv)](
            q, k, v, m_part, l_part, acc_part, page_table, batch.positions, tile_seq, tile_tok0, tile_ntok,
            pa["k_scale"], pa["v_scale"], q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            page_table.stride(0), scale * LOG2E, BLOCK_T=win, INIT=init, LOCAL=local,
            **{"num_warps": 4 if win * gp <= 64 else 8, **SPARSE_WINDOW_LAUNCH}, **consts)
        kernel_kw = dict(m_part_ptr=m_part, l_part_ptr=l_part, acc_part_ptr=acc_part, AFTER_WINDOW=True,
                         INIT=init, LOCAL=local)
    if SPARSE_ATTN_PAGE_LIST:  # each entry's page, in block_idx's layout (-1 entries: any valid page)
        pages = page_table[tok_seq[None, :, None], block_idx.clamp_min(0)]
        kernel_kw.update(page_idx_ptr=pages.contiguous(), PAGE_LIST=True)
    _sparse_prefill_attn_kernel[(N, hkv)](
        q, k, v, out, block_idx, page_table, tok_seq, batch.positions, pa["k_scale"], pa["v_scale"],
        *strides, block_idx.stride(0), block_idx.stride(1), page_table.stride(0), scale * LOG2E,
        W=block_idx.shape[-1], **consts, **kernel_kw,
        F16_DOTS=SPARSE_FP8_F16_DOTS and _f16_dots(pa),
        **{"num_warps": _PER_TOKEN_WARPS[pa["fp8"]], **SPARSE_ATTN_LAUNCH})
    return out


def sparse_attention(q: torch.Tensor, kv: KVPool, comp: CompressedKeyPool, layer: int,
                     batch: ForwardBatch, cfg: ModelConfig, **select_kw) -> torch.Tensor:
    """TorchBackend.sparse_attention's contract: q [N, Hq, d] -> [N, Hq, d] in q.dtype, per-token
    InfLLM-v2 selection and block-sparse attention. Meant for prefill batches of sparse sequences;
    dense sequences are also exact (every causal block is listed) but a dense kernel is faster."""
    scale = cfg.head_dim ** -0.5
    block_idx = select_blocks_prefill(q, comp, layer, batch, cfg.sparse, scale, **select_kw)
    return sparse_prefill_attention(q, kv, layer, batch, block_idx, scale,
                                    window=(cfg.sparse.init_blocks, cfg.sparse.local_blocks), ascending=True)
