"""`update_compressed`: every C1/C2 compressed-key entry born during the step, written into the
compressed-key pool (cache/compressed.py) from the paged K pool (fp8 pages dequantized as
KVPool.gather does)."""

from __future__ import annotations

import triton
import triton.language as tl

from salaserve.kernels._triton_utils import pdl_launch_kwargs, pdl_wait_first, round_to, tl_dtype
from salaserve.kernels.attention.common import _pool_args


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
