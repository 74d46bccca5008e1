"""Writing a step's new K/V rows into the paged pool (`store_kv`: one launch for K and V; fp8 pools
get their (page, KV head) scales set and the rows quantized in the same kernel, as KVPool.write), and
reading fp8 pages back in the compute dtype (`dequantize_pages`, KVPool.gather's values)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.cache.pages import FP8_HEADROOM as _PAGES_FP8_HEADROOM
from salaserve.kernels._triton_utils import pdl_launch_kwargs, pdl_wait_first, round_to, round_to_e4m3

FP8_MAX = tl.constexpr(448.0)  # largest e4m3 value (constexprs: read inside kernels)
FP8_HEADROOM = tl.constexpr(_PAGES_FP8_HEADROOM)


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
