"""Block-sparse prefill attention over the selected blocks of the paged KV cache (Triton):
the window kernel for the forced blocks, then the per-token kernel over the scored ones."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import FP8_STAGE_MAX_BYTES, KVPool
from salaserve.config import ModelConfig
from salaserve.core.batch import ForwardBatch
from salaserve.kernels._triton_utils import tl_dtype
from salaserve.kernels.attention.common import _load_kv, _pool_args
from salaserve.kernels.attention.kv_store import dequantize_pages
from salaserve.kernels.sparse._common import LOG2E, _dot_precision, _load_q_rows, _pow2, _step_tiles, _tile_rows
from salaserve.kernels.sparse.selection import select_blocks_prefill

@triton.jit
def _softmax_block(q, k_ptrs, v_ptrs, visible, scale_off, k_scale_ptr, v_scale_ptr, m, l, acc, scale2,
                   KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One K/V block of the online softmax (base 2) of the rows q: scores outside `visible`
    [rows, BS] are -inf; fp8 pages take their (page, KV head) scales at scale_off on the scores and
    on the probabilities. A row that sees nothing in this block keeps (m, l, acc) exactly; one
    that has seen nothing yet keeps m = -inf, l = 0, acc = 0. Returns the new (m, l, acc)."""
    k = _load_kv(k_ptrs, KV_FP8, COMPUTE_DT)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale2
    if KV_FP8:
        s = s * tl.load(k_scale_ptr + scale_off)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = _load_kv(v_ptrs, KV_FP8, COMPUTE_DT)
    if KV_FP8:
        p = p * tl.load(v_scale_ptr + scale_off)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l, acc


@triton.jit
def _selected_block(q, b, page, pos, g, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, stride_kp, stride_ks, stride_kh, m, l,
                    acc, scale2, D: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr,
                    DOT_PREC: tl.constexpr, HKV: tl.constexpr):
    """Block b (in page `page`) of a sequence in one token's online softmax."""
    d = tl.arange(0, D)
    s_off = tl.arange(0, BS)
    page = page.to(tl.int64)  # pools exceed 2^31 elements
    kv_off = page * stride_kp + s_off[:, None] * stride_ks + g * stride_kh + d[None, :]
    # every selected block is <= the query's block, so each has a visible key: m stays finite
    return _softmax_block(q, k_ptr + kv_off, v_ptr + kv_off, (b * BS + s_off)[None, :] <= pos, page * HKV + g,
                          k_scale_ptr, v_scale_ptr, m, l, acc, scale2, KV_FP8, COMPUTE_DT, DOT_PREC)


@triton.jit
def _sparse_prefill_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_idx_ptr, page_idx_ptr, positions_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
    stride_bg, stride_bt,
    scale2,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, W: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
    m_part_ptr=None, l_part_ptr=None, acc_part_ptr=None,
    AFTER_WINDOW: tl.constexpr = False, INIT: tl.constexpr = 1, LOCAL: tl.constexpr = 32,
):
    """One program per (token, KV head g): the group's query heads are the M dimension of tl.dot
    (padded to GP >= 16), iterating over the token's selected blocks. page_idx_ptr holds each
    entry's page (block_idx's layout, made before the kernel), so the loop loads the page and then
    its K/V: two dependent loads instead of three through the page table, and fewer registers.
    Causal mask inside the current block; fp32 online softmax (base 2).
    AFTER_WINDOW: the forced blocks (init, local window) were done by _sparse_window_attn_kernel;
    start from its softmax state ([N, Hq] m and l, [N, Hq, D] acc) and skip them here."""
    tok, g = tl.program_id(0), tl.program_id(1)
    pos = tl.load(positions_ptr + tok)
    h = tl.arange(0, GP)
    h_ok = h < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + tok * stride_qt + (g * GROUP + h)[:, None] * stride_qh + d[None, :], mask=h_ok[:, None],
                other=0.0)

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
        page = tl.load(page_idx_ptr + g * stride_bg + tok * stride_bt + i)
        m, l, acc = _selected_block(q, b, page, pos, g, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, stride_kp,
                                    stride_ks, stride_kh, m, l, acc, scale2, D, BS, KV_FP8, COMPUTE_DT, DOT_PREC, HKV)
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


# Tokens per program of the window kernel: the init and local-window blocks (34 of a token's 96 at
# the real config) are read once per tile of consecutive tokens, which share them exactly, and the
# per-token kernel walks only the scored ones (an 8K chunk at 128K: 6795 -> 6250 us per call; 4
# tokens per program: 6446).
SPARSE_WINDOW_TOKENS = 8
# Launch options: the window kernel capped at 128 registers (two programs per SM) at 2 stages
# (window + per-token attention 5.83 -> 5.48 ms per 8K chunk at 128K); the per-token kernel with
# 2 warps on bf16 pages (-5% against 4) and 4 on fp8 pages, which spill at 2 (sm_90: 255
# registers, 48 bytes of stack). A register cap or 8 warps did not help the per-token kernel.
SPARSE_WINDOW_LAUNCH = dict(num_stages=2, maxnreg=128)
_PER_TOKEN_WARPS = {False: 2, True: 4}
# fp8 pages: the prefill batch's pages of the layer are dequantized once (attention.dequantize_pages,
# KVPool.gather's values) and the bf16-page kernels run on that copy. The per-token kernel reads each
# page once for every query token that selects it, so in-kernel the e4m3 converts repeat for each of
# those reads: a 32K prefill's per-token kernel 220.8 -> 124.7 ms (bf16 pages: 123.7), its kernels
# 1.171 -> 1.101 s. The copy is transient, one layer at a time: 2 * Hkv * d * 2 bytes per token of the
# batch's sequences (1 KiB at full size), at most SPARSE_FP8_STAGE_MAX_BYTES; longer batches keep the
# in-kernel converts.
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
    """The batch's pages of `layer` dequantized into a fresh compute-dtype copy (see SPARSE_FP8_STAGE_MAX_BYTES):
    (K, V [P, block_size, Hkv, d], a page table into them (_staged_table), the pool arguments of a plain
    pool), or None when the copy would exceed SPARSE_FP8_STAGE_MAX_BYTES."""
    _, bs, hkv, d = kv.k[layer].shape
    pages, table = _staged_table(batch, bs)  # once per step; its page count sizes the copy
    if 2 * pages.numel() * bs * hkv * d * kv.compute_dtype.itemsize > SPARSE_FP8_STAGE_MAX_BYTES:
        return None
    k, v = dequantize_pages(kv, layer, pages)
    return k, v, table, dict(k_scale=k, v_scale=v, fp8=False, compute=k.dtype)


def sparse_prefill_attention(q: torch.Tensor, kv: KVPool, layer: int, batch: ForwardBatch,
                             block_idx: torch.Tensor, scale: float, window: tuple[int, int] | None = None,
                             window_tokens: int | None = None, ascending: bool = False) -> torch.Tensor:
    """q [N, Hq, d]; block_idx [Hkv, N, W] int32 (ascending or not, valid entries first, -1 after).
    Each query attends to the keys of its selected blocks that are <= its position. Returns
    [N, Hq, d] in q.dtype.
    window = (init_blocks, local_blocks) (sparse_attention passes it): the forced blocks (b <
    init_blocks, or qb - local_blocks <= b <= qb for a token in block qb) go through the window
    kernel, window_tokens (a power of two; default SPARSE_WINDOW_TOKENS) tokens per program, and the
    per-token kernel (grid (N, Hkv)) over the others. Every token's list must then hold all of its
    forced blocks, as InfLLM-v2's selection does (they score +inf); lists not known to be ascending
    (`ascending`) are sorted first. window None: the per-token kernel over every listed block (any
    lists)."""
    window_tokens = SPARSE_WINDOW_TOKENS if window_tokens is None else window_tokens
    if window_tokens < 1 or window_tokens & (window_tokens - 1):
        raise ValueError(f"window_tokens must be a power of two, got {window_tokens}")
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
    staged = _staged_pages(kv, layer, batch) if pa["fp8"] else None
    if staged is not None:  # the plain-pool kernels on a dequantized copy of the batch's pages
        k, v, page_table, pa = staged
    consts = dict(GROUP=group, GP=gp, D=D, BS=kv.block_size, DOT_PREC=_dot_precision(q.dtype), KV_FP8=pa["fp8"],
                  COMPUTE_DT=tl_dtype(pa["compute"]), HKV=hkv)
    width = block_idx.shape[-1]
    if width & (width - 1):  # the kernel reads a power-of-two row to count valid entries
        block_idx = torch.nn.functional.pad(block_idx, (0, _pow2(width) - width), value=-1)
    block_idx = block_idx.contiguous()
    tok_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=q.device),
                                      batch.cu_seqlens_q.diff(), output_size=N)
    kernel_kw = {}  # the per-token kernel's window state
    if window is not None:
        init, local = window
        if not ascending:
            block_idx = _ascending_lists(block_idx)
        m_part = torch.empty(N, Hq, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(N, Hq, D, dtype=torch.float32, device=q.device)
        _, (tile_seq, tile_tok0, tile_ntok) = _step_tiles(batch, window_tokens, q.device)
        _sparse_window_attn_kernel[(tile_seq.numel(), hkv)](
            q, k, v, m_part, l_part, acc_part, page_table, batch.positions, tile_seq, tile_tok0, tile_ntok,
            pa["k_scale"], pa["v_scale"], q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            page_table.stride(0), scale * LOG2E, BLOCK_T=window_tokens, INIT=init, LOCAL=local,
            **{"num_warps": 4 if window_tokens * gp <= 64 else 8, **SPARSE_WINDOW_LAUNCH}, **consts)
        kernel_kw = dict(m_part_ptr=m_part, l_part_ptr=l_part, acc_part_ptr=acc_part, AFTER_WINDOW=True,
                         INIT=init, LOCAL=local)
    # each entry's page, in block_idx's layout (-1 entries: any valid page)
    pages = page_table[tok_seq[None, :, None], block_idx.clamp_min(0)].contiguous()
    _sparse_prefill_attn_kernel[(N, hkv)](
        q, k, v, out, block_idx, pages, batch.positions, pa["k_scale"], pa["v_scale"],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2),
        block_idx.stride(0), block_idx.stride(1), scale * LOG2E,
        W=block_idx.shape[-1], **consts, **kernel_kw, num_warps=_PER_TOKEN_WARPS[pa["fp8"]])
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
