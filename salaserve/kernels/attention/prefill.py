"""`dense_prefill_attention`: varlen causal flash attention of a step's new tokens over the whole
paged cache of their sequences (the dense sequences of a prefill step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import tl_dtype
from salaserve.kernels.attention.common import LOG2E, _dot_precision, _load_kv, _pool_args

# Default tile configuration (retuned from bench_attention.py on the H200).
PREFILL_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)


@triton.jit
def _prefill_kv_tile(
    q, m_i, l_i, acc, K_pool, V_pool, page_row, n0, kv_end, pos, head_off,
    stride_kp, stride_kt, scale_log2,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
    K_scale_g, V_scale_g, KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, HKV: tl.constexpr,
):
    keys = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if MASKED:
        k_ok = keys < kv_end
    if BLOCK_SIZE % BLOCK_N == 0:
        # the tile lies inside one page: one page-table read (n0 < kv_end, so the page exists)
        page = tl.load(page_row + n0 // BLOCK_SIZE).to(tl.int64)
    elif MASKED:
        # a tile spanning several pages: each key row finds its own page
        page = tl.load(page_row + keys // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    else:
        page = tl.load(page_row + keys // BLOCK_SIZE).to(tl.int64)
    off = page * stride_kp + (keys % BLOCK_SIZE) * stride_kt + head_off
    if MASKED:
        k = _load_kv(K_pool + off[:, None] + d[None, :], KV_FP8, COMPUTE_DT, k_ok[:, None])
        v = _load_kv(V_pool + off[:, None] + d[None, :], KV_FP8, COMPUTE_DT, k_ok[:, None])
    else:
        k = _load_kv(K_pool + off[:, None] + d[None, :], KV_FP8, COMPUTE_DT)
        v = _load_kv(V_pool + off[:, None] + d[None, :], KV_FP8, COMPUTE_DT)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
    if KV_FP8:
        # fp8 pages: each key row's scale (its page, this program's KV head) on the score columns
        sc = page * HKV + tl.zeros([BLOCK_N], dtype=tl.int64)
        ks = tl.load(K_scale_g + sc)
        vs = tl.load(V_scale_g + sc)
        qk = qk * ks[None, :]
    if MASKED:
        # bottom-right causal: the row at absolute position p sees keys 0..p
        qk = tl.where(keys[None, :] <= pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if KV_FP8:
        p = p * vs[None, :]  # V's scales ride on the probabilities (l_i above takes them unscaled)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return m_new, l_i, acc


# the step's sizes are not specialised on: one compiled kernel for every step (compile_watch.py)
@triton.jit(do_not_specialize=['num_tiles'])
def _dense_prefill_kernel(
    Q, K_pool, V_pool, Out, page_table, cu_seqlens_q, seq_lens, K_scale, V_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_pt, stride_kp, stride_kt, stride_kh,
    scale_log2, num_tiles,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
):
    # Grid (num_tiles, B, Hkv). A tile is TOK consecutive query tokens x the GROUP query heads of
    # KV head g, packed as BLOCK_M = TOK * GROUP rows (row r: token r // GROUP, head r % GROUP).
    TOK: tl.constexpr = BLOCK_M // GROUP
    # Later tiles see more keys (causal): hand them out first so the heavy work starts early.
    tile = num_tiles - 1 - tl.program_id(0)
    b = tl.program_id(1)
    g = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + b)
    q_len = tl.load(cu_seqlens_q + b + 1) - q_start
    t0 = tile * TOK
    if t0 >= q_len:
        return
    cache_len = tl.load(seq_lens + b) - q_len

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // GROUP
    head = g * GROUP + r % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q = q.to(COMPUTE_DT)  # the pool's dtype, or the dots' dtype for fp8 pools
    pos = cache_len + tok  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    page_row = page_table + b.to(tl.int64) * stride_pt
    head_off = g * stride_kh

    # Keys below the tile's first position are visible to every row: no mask there. The last
    # few key tiles straddle the causal diagonal and are masked.
    kv_end = cache_len + tl.minimum(t0 + TOK, q_len)
    full_end = ((cache_len + t0 + 1) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _prefill_kv_tile(q, m_i, l_i, acc, K_pool, V_pool, page_row, n0, kv_end, pos,
                                         head_off, stride_kp, stride_kt, scale_log2,
                                         BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, DOT_PREC,
                                         K_scale + g, V_scale + g, KV_FP8, COMPUTE_DT, HKV)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _prefill_kv_tile(q, m_i, l_i, acc, K_pool, V_pool, page_row, n0, kv_end, pos,
                                         head_off, stride_kp, stride_kt, scale_log2,
                                         BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, DOT_PREC,
                                         K_scale + g, V_scale + g, KV_FP8, COMPUTE_DT, HKV)

    out = acc / l_i[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def dense_prefill_attention(q: torch.Tensor, kv_pool, layer: int, batch, scale: float,
                            config: dict | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over all its keys in the pages.

    q: [N, Hq, d] packed varlen by batch.cu_seqlens_q (d contiguous; token/head strides free).
    The query at absolute position p = cache_len + t (cache_len = seq_len - q_len) sees keys 0..p
    of its sequence (bottom-right aligned causal), read through batch.page_table. GQA: head h uses
    KV head h // (Hq // Hkv). fp32 online softmax; returns [N, Hq, d] in q.dtype.
    The step's keys must already be stored (store_kv). Not meant for graph capture (the grid
    depends on the longest q_len of the batch, read from the host mirrors).
    """
    cfg = dict(PREFILL_CONFIG, **(config or {}))
    kp, vp = kv_pool.k[layer], kv_pool.v[layer]
    n, hq, d = q.shape
    _, block_size, hkv, dk = kp.shape
    assert dk == d and hq % hkv == 0 and kp.is_contiguous() and vp.is_contiguous()
    group = hq // hkv
    block_m = max(cfg["BLOCK_M"], triton.next_power_of_2(group))
    assert block_m % group == 0, "GROUP must divide BLOCK_M"
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    tok_per_tile = block_m // group
    num_tiles = triton.cdiv(max(batch.q_lens_host), tok_per_tile)
    pt = batch.page_table
    grid = (num_tiles, batch.num_seqs, hkv)
    pa = _pool_args(kv_pool, layer)
    _dense_prefill_kernel[grid](
        q, kp, vp, out, pt, batch.cu_seqlens_q, batch.seq_lens, pa["k_scale"], pa["v_scale"],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), pt.stride(0),
        kp.stride(0), kp.stride(1), kp.stride(2),
        scale * LOG2E, num_tiles,
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        DOT_PREC=_dot_precision(pa["compute"]), KV_FP8=pa["fp8"], COMPUTE_DT=tl_dtype(pa["compute"]), HKV=hkv,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
