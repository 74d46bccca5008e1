"""Triton kernels for the sparse layers' dense attention and cache maintenance.

What lives here (the InfLLM-v2 selection and the per-token block-sparse attention live elsewhere):

- `store_kv`                 scatter a step's new K/V rows into the paged pool (one launch for K and V)
- `update_compressed`        write every C1/C2 compressed-key entry born during the step
- `dense_prefill_attention`  varlen causal flash attention of new tokens over the whole paged cache
- `paged_decode_attention`   one query per sequence over a per-(sequence, KV head) list of pages,
                             split over programs (flash-decoding) + a small reduction kernel
- `dense_block_table`        the all-pages list for dense sequences, built on the device

Layouts (see cache/pages.py, cache/compressed.py, engine/batch.py):
- K/V pool of one layer: [num_pages, block_size, Hkv, d], contiguous; page b of a sequence holds its
  tokens [b*block_size, (b+1)*block_size).
- page ids are int32 in the tables; every address into a pool is formed in int64 (a pool layer can
  exceed 2^31 elements).
- GQA: query head h uses KV head h // (Hq // Hkv). The attention kernels pack the GROUP query
  heads of one KV head as rows of the tl.dot M dimension, so each K/V tile is loaded once for the
  whole group.

FP8 pools (`--kv-cache-dtype fp8_e4m3`, cache/pages.py): K/V pages in e4m3 with an fp32 scale per
(layer, page, KV head). store_kv sets the scales and quantizes in one kernel, as KVPool.write
(same scales, same e4m3 codes). The attention kernels feed the e4m3 codes, converted exactly, to
the dots and apply the scales to the score tile (per key column) and to the probabilities before
p @ v: the same products as with dequantized pages, without rounding K and V to the compute dtype
(the torch backend's KVPool.gather rounds them once). The compressed-key update dequantizes as
KVPool.gather does.

Graph safety: the decode-path wrappers (store_kv, update_compressed on a decode batch,
paged_decode_attention, dense_block_table) never read device tensors on the host; their grids depend
only on static shapes (B, Hkv, num_splits, max_sel) and on host-side batch mirrors that are fixed for
a captured decode batch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from salaserve.cache.pages import FP8_HEADROOM as _PAGES_FP8_HEADROOM
from salaserve.kernels._triton_utils import pdl_launch_kwargs, pdl_wait_first, round_to, round_to_e4m3, tl_dtype

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(448.0)  # largest e4m3 value (constexprs: read inside kernels)
FP8_HEADROOM = tl.constexpr(_PAGES_FP8_HEADROOM)

# Default tile configurations (the lead retunes them from bench_attention.py on the H200).
PREFILL_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
DECODE_CONFIG = dict(num_warps=4, num_stages=3)


def _dot_precision(dtype: torch.dtype):
    # fp32 tl.dot defaults to tf32 on the GPU; fp32 pools (tests, tiny model) want exact products.
    return "ieee" if dtype == torch.float32 else None


def _pool_args(kv_pool, layer: int) -> dict:
    """The scale pointers and dtypes a page-reading kernel needs: scales [num_pages, Hkv] of the
    layer (fp8 pools; the K pool itself as an unused placeholder otherwise), the compute dtype."""
    if kv_pool.fp8:
        return dict(k_scale=kv_pool.k_scale[layer], v_scale=kv_pool.v_scale[layer], fp8=True,
                    compute=kv_pool.compute_dtype)
    return dict(k_scale=kv_pool.k[layer], v_scale=kv_pool.v[layer], fp8=False, compute=kv_pool.k.dtype)


@triton.jit
def _load_kv(ptr, KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, mask=None):
    """A K or V tile for the attention dots. fp8 pools: the e4m3 codes converted exactly to the
    compute dtype, unscaled: the attention kernels apply the (page, KV head) scales to the small
    score tile (q . k) and to the probabilities (p before p @ v), one multiply per key instead of
    a multiply and a rounding per element."""
    if mask is None:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    if KV_FP8:
        x = x.to(COMPUTE_DT)
    return x


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


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    K_new, V_new, K_pool, V_pool, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    pdl_wait_first(PDL)
    # One program per new token: its K and V rows ([Hkv, d] each) go to pool slot
    # `slot_mapping[t]` (= page * block_size + offset). A negative slot marks a padded token of a
    # captured decode batch and is skipped.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HEAD_DIM)
        mask = h[:, None] < HKV
        k = tl.load(K_new + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(V_new + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        # The pool's token rows are contiguous [Hkv, d] blocks.
        dst = slot * (HKV * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
        tl.store(K_pool + dst, k.to(K_pool.dtype.element_ty), mask=mask)
        tl.store(V_pool + dst, v.to(V_pool.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(x_ptr, t0, rows, ok, stride_t, stride_h, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """Rows t0 + rows of x [N, Hkv, d] as fp32 [rows, BLOCK_H, d] (0 where not ok), and the mask."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    m = ok[:, None, None] & (h[None, :, None] < HKV)
    x = tl.load(x_ptr + (t0 + rows)[:, None, None].to(tl.int64) * stride_t + h[None, :, None] * stride_h
                + d[None, None, :], mask=m, other=0.0).to(tl.float32)
    return x, m


@triton.jit
def _quantize_rows(x_ptr, pool, scale, t0, rows, ok, stride_t, stride_h, dst_slot,
                   HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows t0 + rows (where ok) of x [N, Hkv, d] / the page's scale per KV head [BLOCK_H],
    clamped and rounded to e4m3 as KVPool.write, stored at pool slots dst_slot [rows]."""
    x, m = _load_rows(x_ptr, t0, rows, ok, stride_t, stride_h, HKV, HEAD_DIM, BLOCK_H)
    q = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale[None, :, None]), -FP8_MAX), FP8_MAX))
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    dst = dst_slot[:, None, None] * (HKV * HEAD_DIM) + h[None, :, None] * HEAD_DIM + d[None, None, :]
    tl.store(pool + dst, q.to(pool.dtype.element_ty), mask=m)


@triton.jit
def _same_page_rows(slot_mapping, t, rows, slot, n_tokens):
    """Which batch rows t + rows hold the slots slot + rows (the page's next tokens in this step)."""
    ok = t + rows < n_tokens
    return ok & (tl.load(slot_mapping + t + rows, mask=ok, other=-1) == slot + rows)


@triton.jit
def _scale_and_store_page(K_new, V_new, K_pool, V_pool, slot_mapping, K_scale, V_scale, n_tokens, t, slot, n_rows,
                          stride_kt, stride_kh, stride_vt, stride_vh, sc_off,
                          HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    """The page's fresh scales from rows t .. t + n_rows of this step (tiles of ROWS rows), then
    those rows quantized into it."""
    h = tl.arange(0, BLOCK_H)
    kmax = tl.zeros([BLOCK_H], dtype=tl.float32)
    vmax = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i0 in range(0, n_rows, ROWS):
        i = i0 + tl.arange(0, ROWS)
        ok = _same_page_rows(slot_mapping, t, i, slot, n_tokens)
        kx, _ = _load_rows(K_new, t, i, ok, stride_kt, stride_kh, HKV, HEAD_DIM, BLOCK_H)
        vx, _ = _load_rows(V_new, t, i, ok, stride_vt, stride_vh, HKV, HEAD_DIM, BLOCK_H)
        kmax = tl.maximum(kmax, tl.max(tl.max(tl.abs(kx), axis=2), axis=0))
        vmax = tl.maximum(vmax, tl.max(tl.max(tl.abs(vx), axis=2), axis=0))
    ks = tl.maximum(kmax * (FP8_HEADROOM / FP8_MAX), 1e-12)
    vs = tl.maximum(vmax * (FP8_HEADROOM / FP8_MAX), 1e-12)
    tl.store(K_scale + sc_off + h, ks, mask=h < HKV)
    tl.store(V_scale + sc_off + h, vs, mask=h < HKV)
    for i0 in range(0, n_rows, ROWS):
        i = i0 + tl.arange(0, ROWS)
        ok = _same_page_rows(slot_mapping, t, i, slot, n_tokens)
        _quantize_rows(K_new, K_pool, ks, t, i, ok, stride_kt, stride_kh, slot + i, HKV, HEAD_DIM, BLOCK_H)
        _quantize_rows(V_new, V_pool, vs, t, i, ok, stride_vt, stride_vh, slot + i, HKV, HEAD_DIM, BLOCK_H)


@triton.jit
def _store_kv_fp8_kernel(
    K_new, V_new, K_pool, V_pool, slot_mapping, K_scale, V_scale, n_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    pdl_wait_first(PDL)
    # One program per new token, KVPool.write's semantics in one launch (graph-safe, no torch ops):
    # a page whose first slot is written in this step gets a fresh scale, per KV head, from the
    # amax of this step's tokens of that page x FP8_HEADROOM / 448. Those tokens are consecutive
    # rows of the batch (a sequence's tokens are packed in position order), so the program of the
    # page's first token computes the scale and quantizes all of them; their own programs skip.
    # Tokens of a page begun in an earlier step use the page's stored scale.
    # The page's rows are counted first and only those are visited: a decode token opening a page
    # once visited all BLOCK_SIZE candidate rows (one IEEE division and e4m3 rounding per element
    # of each), 56 us per call on the H200 where the bf16 store takes ~2 us.
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        off = slot % BLOCK_SIZE
        page = slot // BLOCK_SIZE
        sc_off = page * HKV
        begun_here = False
        if off > 0 and t >= off:
            begun_here = tl.load(slot_mapping + t - off) == slot - off
        if off == 0:
            # this step's rows of the page: a prefix of rows t, t+1, ... (see _same_page_rows)
            n_rows = tl.sum(_same_page_rows(slot_mapping, t, tl.arange(0, BLOCK_SIZE), slot, n_tokens).to(tl.int32))
            if n_rows == 1:  # decode
                _scale_and_store_page(K_new, V_new, K_pool, V_pool, slot_mapping, K_scale, V_scale, n_tokens, t,
                                      slot, n_rows, stride_kt, stride_kh, stride_vt, stride_vh, sc_off,
                                      HKV, HEAD_DIM, BLOCK_H, 1)
            else:
                _scale_and_store_page(K_new, V_new, K_pool, V_pool, slot_mapping, K_scale, V_scale, n_tokens, t,
                                      slot, n_rows, stride_kt, stride_kh, stride_vt, stride_vh, sc_off,
                                      HKV, HEAD_DIM, BLOCK_H, ROWS)
        elif not begun_here:
            one = tl.arange(0, 1)
            ks = tl.load(K_scale + sc_off + h, mask=h < HKV, other=1.0)
            vs = tl.load(V_scale + sc_off + h, mask=h < HKV, other=1.0)
            _quantize_rows(K_new, K_pool, ks, t, one, one == 0, stride_kt, stride_kh, slot + one, HKV, HEAD_DIM, BLOCK_H)
            _quantize_rows(V_new, V_pool, vs, t, one, one == 0, stride_vt, stride_vh, slot + one, HKV, HEAD_DIM, BLOCK_H)


def store_kv(kv_pool, layer: int, k: torch.Tensor, v: torch.Tensor, batch) -> None:
    """Write the step's new keys/values into the pages of `layer`.

    k, v: [N, Hkv, d] (any float dtype, any token/head strides, d contiguous), N = batch tokens.
    batch.slot_mapping: [N] int64 flat slot (page * block_size + offset); negative = skip.
    One launch writes both K and V (torch indexing needs one index_put per tensor, plus a copy when
    the source is a strided view of the fused qkv output).
    """
    n = k.shape[0]
    if n == 0:
        return
    kp, vp = kv_pool.k[layer], kv_pool.v[layer]
    _, _, hkv, d = kp.shape
    assert kp.is_contiguous() and vp.is_contiguous()
    assert k.shape == (n, hkv, d) and v.shape == (n, hkv, d)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if kv_pool.fp8:
        _store_kv_fp8_kernel[(n,)](
            k, v, kp, vp, batch.slot_mapping, kv_pool.k_scale[layer], kv_pool.v_scale[layer], n,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            HKV=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_SIZE=kp.shape[1],
            ROWS=min(16, kp.shape[1]), num_warps=4, **pdl_launch_kwargs(k.device),
        )
        return
    _store_kv_kernel[(n,)](
        k, v, kp, vp, batch.slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HKV=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv),
        num_warps=1 if hkv * d <= 512 else 4, **pdl_launch_kwargs(k.device),
    )


# ---------------------------------------------------------------------------------------------
# dequantize_pages
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dequantize_pages_kernel(K_pool, V_pool, K_scale, V_scale, pages, K_out, V_out,
                             HKV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Grid (P, Hkv): entry i of the page list, KV head g. Codes times the (page, KV head) scale in
    # fp32, rounded once to the output dtype: KVPool.gather's values.
    i = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    page = tl.load(pages + i).to(tl.int64)
    s = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    row = s[:, None] * (HKV * HEAD_DIM) + g * HEAD_DIM + d[None, :]
    src = page * (BLOCK_SIZE * HKV * HEAD_DIM) + row
    dst = i * (BLOCK_SIZE * HKV * HEAD_DIM) + row
    k = tl.load(K_pool + src).to(tl.float32) * tl.load(K_scale + page * HKV + g)
    v = tl.load(V_pool + src).to(tl.float32) * tl.load(V_scale + page * HKV + g)
    # round_to: round to nearest even on the bits (the interpreter's own bf16 cast truncates)
    tl.store(K_out + dst, round_to(k, K_out.dtype.element_ty).to(K_out.dtype.element_ty))
    tl.store(V_out + dst, round_to(v, V_out.dtype.element_ty).to(V_out.dtype.element_ty))


def dequantize_pages(kv_pool, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages `pages` [P] (int) of an fp8 pool's layer as K, V [P, block_size, Hkv, d] in the pool's
    compute dtype, with KVPool.gather's values. For kernels whose reads of a page repeat (the
    block-sparse prefill reads each page once per query token that selects it): one conversion
    per page instead of one per read."""
    if not kv_pool.fp8:
        raise ValueError("dequantize_pages wants an fp8 KV pool")
    kp, vp = kv_pool.k[layer], kv_pool.v[layer]
    _, block_size, hkv, d = kp.shape
    pages = pages.to(device=kp.device, dtype=torch.int32).contiguous()
    k = torch.empty((pages.numel(), block_size, hkv, d), dtype=kv_pool.compute_dtype, device=kp.device)
    v = torch.empty_like(k)
    if pages.numel():
        _dequantize_pages_kernel[(pages.numel(), hkv)](
            kp, vp, kv_pool.k_scale[layer], kv_pool.v_scale[layer], pages, k, v,
            HKV=hkv, BLOCK_SIZE=block_size, HEAD_DIM=d, num_warps=4)
    return k, v


# ---------------------------------------------------------------------------------------------
# update_compressed
# ---------------------------------------------------------------------------------------------


@triton.jit
def _compress_level(
    K_pool, C_pool, page_row, e, n_progs, old_len, new_len,
    stride_kp, stride_kt, stride_cp, stride_ce,
    KERNEL: tl.constexpr, STRIDE: tl.constexpr, PER_PAGE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HD: tl.constexpr, BLOCK_HD: tl.constexpr, CHUNK: tl.constexpr,
    K_scale, KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, HKV: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Entries [first, last) are born in this step: entry j exists once token j*STRIDE+KERNEL-1 is
    # stored, i.e. count(L) = (L - KERNEL) // STRIDE + 1 for L >= KERNEL.
    first = tl.where(old_len >= KERNEL, (old_len - KERNEL) // STRIDE + 1, 0)
    last = tl.where(new_len >= KERNEL, (new_len - KERNEL) // STRIDE + 1, 0)
    if KV_FP8:
        _compress_level_fp8(K_pool, C_pool, page_row, e, n_progs, first, last, stride_kp, stride_kt, stride_cp,
                            stride_ce, KERNEL, STRIDE, PER_PAGE, BLOCK_SIZE, HD, CHUNK, K_scale, COMPUTE_DT, HKV,
                            BLOCK_HKV, BLOCK_D)
    else:
        c = tl.arange(0, BLOCK_HD)  # all KV heads of a token at once: [Hkv * d] is contiguous
        c_ok = c < HD
        for j in range(first + e, last, n_progs):
            acc = tl.zeros([BLOCK_HD], dtype=tl.float32)
            for t0 in tl.static_range(0, KERNEL, CHUNK):
                u = t0 + tl.arange(0, CHUNK)
                tok = j * STRIDE + u
                ok = u < KERNEL
                # A window may straddle pages: look up each token's page.
                page = tl.load(page_row + tok // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
                ptr = K_pool + page[:, None] * stride_kp + (tok % BLOCK_SIZE)[:, None] * stride_kt + c[None, :]
                x = tl.load(ptr, mask=ok[:, None] & c_ok[None, :], other=0.0)
                acc += tl.sum(x.to(tl.float32), axis=0)
            mean = acc / KERNEL  # fp32 accumulation, rounded once to the pool dtype (spec 3.3)
            dst_page = tl.load(page_row + j // PER_PAGE).to(tl.int64)
            dst = C_pool + dst_page * stride_cp + (j % PER_PAGE) * stride_ce + c
            tl.store(dst, mean.to(C_pool.dtype.element_ty), mask=c_ok)


@triton.jit
def _compress_level_fp8(
    K_pool, C_pool, page_row, e, n_progs, first, last, stride_kp, stride_kt, stride_cp, stride_ce,
    KERNEL: tl.constexpr, STRIDE: tl.constexpr, PER_PAGE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HD: tl.constexpr, CHUNK: tl.constexpr, K_scale, COMPUTE_DT: tl.constexpr, HKV: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """_compress_level's loop on an fp8 pool with the token's keys as a [CHUNK, Hkv, d] tile: the
    (page, KV head) scales are one [CHUNK, Hkv] load broadcast over d (the flat [CHUNK, Hkv * d] form
    gathered a scale per element: 0.008 ms slower per window-closing step at 128K). Values
    as KVPool.gather (fp8 * scale rounded once), summed in fp32 over the window."""
    D: tl.constexpr = HD // HKV
    h = tl.arange(0, BLOCK_HKV)
    dd = tl.arange(0, BLOCK_D)
    h_ok = h < HKV
    hd_ok = h_ok[:, None] & (dd < D)[None, :]
    cols = (h * D)[:, None] + dd[None, :]  # [BLOCK_HKV, BLOCK_D] channel of the [Hkv * d] row
    for j in range(first + e, last, n_progs):
        acc = tl.zeros([BLOCK_HKV, BLOCK_D], dtype=tl.float32)
        for t0 in tl.static_range(0, KERNEL, CHUNK):
            u = t0 + tl.arange(0, CHUNK)
            tok = j * STRIDE + u
            ok = u < KERNEL
            page = tl.load(page_row + tok // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)  # windows may straddle pages
            row = page * stride_kp + (tok % BLOCK_SIZE) * stride_kt
            x = tl.load(K_pool + row[:, None, None] + cols[None, :, :], mask=ok[:, None, None] & hd_ok[None, :, :],
                        other=0.0)
            sc = tl.load(K_scale + page[:, None] * HKV + h[None, :], mask=ok[:, None] & h_ok[None, :], other=0.0)
            x = round_to(x.to(tl.float32) * sc[:, :, None], COMPUTE_DT).to(COMPUTE_DT)
            acc += tl.sum(x.to(tl.float32), axis=0)
        mean = acc / KERNEL  # fp32 accumulation, rounded once to the pool dtype (spec 3.3)
        dst_page = tl.load(page_row + j // PER_PAGE).to(tl.int64)
        dst = C_pool + dst_page * stride_cp + (j % PER_PAGE) * stride_ce + cols
        tl.store(dst, mean.to(C_pool.dtype.element_ty), mask=hd_ok)


# the step's sizes are not specialised on: one compiled kernel for every step (compile_watch.py)
@triton.jit(do_not_specialize=['n_progs'])
def _update_compressed_kernel(
    K_pool, C1_pool, C2_pool, page_table, seq_lens, cache_lens, n_progs, K_scale,
    stride_pt, stride_kp, stride_kt, stride_c1p, stride_c1e, stride_c2p, stride_c2e,
    K1: tl.constexpr, S1: tl.constexpr, PER1: tl.constexpr, CH1: tl.constexpr,
    K2: tl.constexpr, S2: tl.constexpr, PER2: tl.constexpr, CH2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HD: tl.constexpr, BLOCK_HD: tl.constexpr,
    KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, HKV: tl.constexpr,
    BLOCK_HKV: tl.constexpr = 1, BLOCK_D: tl.constexpr = 1,  # fp8 pools: the [Hkv, d] tile of a token
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    pdl_wait_first(PDL)
    # Grid (B, n_progs): program (b, e) writes the new entries first+e, first+e+n_progs, ... of
    # sequence b at both levels. The grid is fixed; whether there is anything to write is decided
    # here from seq_lens/cache_lens (a decode step writes at most one entry per level).
    b = tl.program_id(0)
    e = tl.program_id(1)
    new_len = tl.load(seq_lens + b)
    old_len = tl.load(cache_lens + b)
    page_row = page_table + b.to(tl.int64) * stride_pt
    _compress_level(K_pool, C1_pool, page_row, e, n_progs, old_len, new_len,
                    stride_kp, stride_kt, stride_c1p, stride_c1e,
                    K1, S1, PER1, BLOCK_SIZE, HD, BLOCK_HD, CH1, K_scale, KV_FP8, COMPUTE_DT, HKV,
                    BLOCK_HKV, BLOCK_D)
    _compress_level(K_pool, C2_pool, page_row, e, n_progs, old_len, new_len,
                    stride_kp, stride_kt, stride_c2p, stride_c2e,
                    K2, S2, PER2, BLOCK_SIZE, HD, BLOCK_HD, CH2, K_scale, KV_FP8, COMPUTE_DT, HKV,
                    BLOCK_HKV, BLOCK_D)


def _entries(length: int, kernel: int, stride: int) -> int:
    return (length - kernel) // stride + 1 if length >= kernel else 0


def update_compressed(kv_pool, comp_pool, layer: int, batch, max_new_entries: int | None = None) -> None:
    """Write every C1/C2 entry born in this step (call after store_kv of the same step).

    C1 entry j = mean of keys [j*s1, j*s1 + k1) stored at page_table[j // c1_per_page], slot
    j % c1_per_page; C2 likewise with (k2, s2, c2_per_page). Means accumulate in fp32 and are
    stored in the pool dtype. Grid (B, P): P programs per sequence share its new entries; for a
    decode batch P = 1 (at most one new entry per level) and the launch is unconditional, so it is
    CUDA-graph capturable. `max_new_entries` overrides P (else it comes from the host mirrors).
    """
    sc = comp_pool.sc
    k1, s1, k2, s2 = sc.kernel_size, sc.kernel_stride, sc.c2_kernel_size, sc.c2_kernel_stride
    B = batch.num_seqs
    if max_new_entries is not None:
        n_progs = max(1, max_new_entries)
    elif batch.is_decode:
        n_progs = 1
    else:
        n_progs = max(
            max(_entries(L, k, s) - _entries(c, k, s) for k, s in ((k1, s1), (k2, s2)))
            for L, c in zip(batch.seq_lens_host, batch.cache_lens_host)
        )
        if n_progs == 0:
            return
    kp = kv_pool.k[layer]
    c1, c2 = comp_pool.c1[layer], comp_pool.c2[layer]
    assert kp.is_contiguous() and c1.is_contiguous() and c2.is_contiguous()
    _, block_size, hkv, d = kp.shape
    pt = batch.page_table
    pa = _pool_args(kv_pool, layer)
    _update_compressed_kernel[(B, n_progs)](
        kp, c1, c2, pt, batch.seq_lens, batch.cache_lens, n_progs, pa["k_scale"],
        pt.stride(0), kp.stride(0), kp.stride(1), c1.stride(0), c1.stride(1), c2.stride(0), c2.stride(1),
        K1=k1, S1=s1, PER1=comp_pool.c1_per_page, CH1=min(triton.next_power_of_2(k1), 32),
        K2=k2, S2=s2, PER2=comp_pool.c2_per_page, CH2=min(triton.next_power_of_2(k2), 32),
        BLOCK_SIZE=block_size, HD=hkv * d, BLOCK_HD=triton.next_power_of_2(hkv * d),
        KV_FP8=pa["fp8"], COMPUTE_DT=tl_dtype(pa["compute"]), HKV=hkv,
        **(dict(BLOCK_HKV=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d)) if pa["fp8"] else {}),
        num_warps=4, **pdl_launch_kwargs(kp.device),
    )


# ---------------------------------------------------------------------------------------------
# dense prefill attention
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# paged decode attention (flash-decoding over a list of pages)
# ---------------------------------------------------------------------------------------------


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
