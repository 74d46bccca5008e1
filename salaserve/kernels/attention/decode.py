"""`paged_decode_attention`: one query per sequence over a per-(sequence, KV head) list of pages,
split over programs (flash-decoding) and reduced by a small second kernel; `dense_block_table`, the
all-pages list of dense sequences built on the device; `choose_num_splits`, the split count (static:
graph-safe)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import pdl_launch_kwargs, pdl_wait_first, tl_dtype
from salaserve.kernels.attention.common import LOG2E, _dot_precision, _load_kv, _pool_args

# Default launch configuration (retuned from bench_attention.py on the H200).
DECODE_CONFIG = dict(num_warps=4, num_stages=3)


@triton.jit
def _dot_q(q, F16_DOTS: tl.constexpr):
    """Query rows as fp16 dots on fp8 pages take them (F16_DOTS; else unchanged): clamped to fp16's range,
    which holds every bf16 q exactly up to 65504 (beyond, bf16 scores were already ~1e9)."""
    if F16_DOTS:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


def _f16_dots(pa: dict) -> bool:
    """Whether the decode attention on fp8 pages takes fp16 dot operands: the pool is fp8 and the model
    computes in bf16 (an fp16 or fp32 model keeps its own dtype). e4m3 -> fp16 is one cvt per two codes
    (-> bf16 is that plus a cvt per code and the repacking); q is clamped to fp16's range (_dot_q), p
    stays in [0, 1] and V's page scale goes on the fp32 product: at least bf16's precision for
    |q| < 65504."""
    return bool(pa["fp8"] and pa["compute"] == torch.bfloat16)


@triton.jit
def _decode_split_kernel(
    Q, K_pool, V_pool, block_table, block_count, seq_lens, Out, O_part, LSE_part, K_scale, V_scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_btb, stride_bth, stride_bcb, stride_bch,
    stride_kp, stride_kt, stride_kh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    scale_log2,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr = False, COMPUTE_DT: tl.constexpr = tl.bfloat16, HKV: tl.constexpr = 1,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
    F16_DOTS: tl.constexpr = False,  # fp8 pools, bf16 compute: fp16 dot operands, V's scale on p @ v (_f16_dots)
):
    pdl_wait_first(PDL)
    # Grid (B, Hkv, NUM_SPLITS). Program (b, g, s) takes its share of the listed pages of
    # (b, g) and attends the GROUP query heads of KV head g (rows of an M = BLOCK_G >= 16 tile)
    # over them. With one split it writes the output; otherwise a normalised partial output and
    # its log2-sum-exp, merged by _decode_reduce_kernel.
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    count = tl.load(block_count + b * stride_bcb + g * stride_bch)
    seq_len = tl.load(seq_lens + b)
    # Every listed page is full except the last one, the page holding token seq_len - 1.
    last_valid = (seq_len - 1) % BLOCK_SIZE + 1
    per_split = tl.cdiv(count, NUM_SPLITS)
    start = s * per_split
    end = tl.minimum(start + per_split, count)

    r = tl.arange(0, BLOCK_G)
    row_ok = r < GROUP
    head = g * GROUP + r
    d = tl.arange(0, HEAD_DIM)
    DOT_DT: tl.constexpr = tl.float16 if F16_DOTS else COMPUTE_DT  # the dots' operand dtype
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q = _dot_q(q, F16_DOTS).to(DOT_DT)  # the pool's dtype, or the dots' dtype for fp8 pools

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    slot = tl.arange(0, BLOCK_SIZE)
    bt_row = block_table + b.to(tl.int64) * stride_btb + g * stride_bth
    for i in range(start, end):
        page = tl.load(bt_row + i).to(tl.int64)
        k_ok = slot < tl.where(i < count - 1, BLOCK_SIZE, last_valid)
        off = page * stride_kp + slot * stride_kt + g * stride_kh
        k = _load_kv(K_pool + off[:, None] + d[None, :], KV_FP8, DOT_DT, k_ok[:, None])
        v = _load_kv(V_pool + off[:, None] + d[None, :], KV_FP8, DOT_DT, k_ok[:, None])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        if KV_FP8:  # the page's scales for this KV head: on the scores and on the probabilities
            qk = qk * tl.load(K_scale + page * HKV + g)
        qk = tl.where(k_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if F16_DOTS:  # p stays in [0, 1] for the fp16 operand; the page's V scale goes on the fp32 product
            acc += tl.dot(p.to(tl.float16), v, input_precision=DOT_PREC) * tl.load(V_scale + page * HKV + g)
        else:
            if KV_FP8:
                p = p * tl.load(V_scale + page * HKV + g)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new

    # An empty split (more splits than pages) leaves l = 0: output 0 with weight exp2(-inf) = 0.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ob + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(O_part + b * stride_pb + head[:, None] * stride_ph + s * stride_ps + d[None, :], out,
                 mask=row_ok[:, None])
        tl.store(LSE_part + b * stride_lb + head * stride_lh + s, lse, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    O_part, LSE_part, Out,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    pdl_wait_first(PDL)
    # Grid (B, Hq): merge the splits of one (sequence, head) by their log2-sum-exp weights.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(LSE_part + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all: all weights 0, output 0
    w = tl.math.exp2(lse - m)
    o = tl.load(O_part + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, kv_pool, layer: int, block_table: torch.Tensor,
                           block_count: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int = 1, config: dict | None = None) -> torch.Tensor:
    """One query token per sequence over a list of pages per (sequence, KV head).

    q: [B, Hq, d] (d contiguous). block_table: [B, Hkv, max_sel] int32 page ids (any strides, e.g.
    an expanded view); block_count: [B, Hkv] int32, entries [0, count) are used, the rest never
    read. seq_lens: [B] int32 total length (the query is token seq_len - 1).
    Contract: every listed page is a full page except the LAST listed one, which must be the page
    holding token seq_len - 1 (it has (seq_len - 1) % block_size + 1 valid keys). An ascending
    list (all pages; or a sorted InfLLM-v2 selection, which always holds the current block)
    satisfies it. The order of the others does not matter.
    num_splits programs share each (sequence, KV head)'s list (flash-decoding); with num_splits > 1
    a second kernel merges them. Grid (B, Hkv, num_splits) + (B, Hq): CUDA-graph capturable.
    Returns [B, Hq, d] in q.dtype.
    """
    cfg = dict(DECODE_CONFIG, **(config or {}))
    kp, vp = kv_pool.k[layer], kv_pool.v[layer]
    B, hq, d = q.shape
    _, block_size, hkv, dk = kp.shape
    assert dk == d and hq % hkv == 0 and kp.is_contiguous() and vp.is_contiguous()
    assert block_table.shape[:2] == (B, hkv) and block_table.stride(2) == 1
    assert block_count.shape == (B, hkv)
    group = hq // hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((B, hq, d), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        o_part = torch.empty((B, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, hq, num_splits), dtype=torch.float32, device=q.device)
    else:  # unused: the split kernel writes `out` directly
        o_part, lse_part = out, out
    pa = _pool_args(kv_pool, layer)
    _decode_split_kernel[(B, hkv, num_splits)](
        q, kp, vp, block_table, block_count, seq_lens, out, o_part, lse_part, pa["k_scale"], pa["v_scale"],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), block_table.stride(1), block_count.stride(0), block_count.stride(1),
        kp.stride(0), kp.stride(1), kp.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        scale * LOG2E,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, DOT_PREC=_dot_precision(pa["compute"]), KV_FP8=pa["fp8"],
        COMPUTE_DT=tl_dtype(pa["compute"]), HKV=hkv, F16_DOTS=_f16_dots(pa),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch_kwargs(q.device),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(B, hq)](
            o_part, lse_part, out,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=d,
            num_warps=4 if d >= 128 else 1, **pdl_launch_kwargs(out.device),
        )
    return out


def dense_block_table(batch_page_table: torch.Tensor, seq_lens: torch.Tensor, kv_heads: int,
                      block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """All pages of each sequence, for paged_decode_attention on dense sequences.

    Returns block_table [B, kv_heads, max_pages] int32 (a stride-0 expanded view of the page table:
    no copy) and block_count [B, kv_heads] int32 = ceil(seq_len / block_size) (expanded view).
    Pure device ops, no host sync: graph-safe.
    """
    B, max_pages = batch_page_table.shape
    table = batch_page_table.to(torch.int32)[:, None, :].expand(B, kv_heads, max_pages)
    count = torch.div(seq_lens.to(torch.int32) + (block_size - 1), block_size, rounding_mode="floor")
    return table, count.to(torch.int32)[:, None].expand(B, kv_heads)


def choose_num_splits(batch_size: int, kv_heads: int, max_blocks: int, num_sms: int = 132,
                      min_blocks_per_split: int = 1, waves: int = 2) -> int:
    """paged_decode_attention's num_splits: up to `waves` programs per SM, each split keeping at least
    `min_blocks_per_split` pages. Static (graph-safe). One page per program and two waves measured
    faster than one wave of at least two pages (at 131080 tokens, batch 1 -0.018 ms on bf16 pages and
    -0.006 on fp8 pages, batch 8 -0.076, batch 32 (4 splits against 2) 8.134 -> 7.879 ms; at 4K,
    batch 1, -0.007). Fewer pages per program shorten each program's serial chain (at batch 8 the old
    rule gave ~12 pages per split); two programs fit per SM."""
    by_sms = max(1, waves * num_sms // max(1, batch_size * kv_heads))
    by_blocks = max(1, math.ceil(max_blocks / min_blocks_per_split))
    return max(1, min(by_sms, by_blocks))
